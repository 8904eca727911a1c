"""``FusedAdam`` (drop-in for apex.optimizers.FusedAdam): Adam / AdamW on the single-process
machinery.

The algorithm (hyperparameters, defaults, checks, the kernel call) is shardopt/algorithms/adam.py,
shared with ``DistributedFusedAdam``; the math is ``csrc/optim/adam_math.h``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt.algorithms import adam
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers.fused_optimizer import FusedOptimizer, maximize_scale

H = adam.Hyperparams  # the defaults below are the algorithm's


class FusedAdam(FusedOptimizer):
    """Adam and AdamW with fused multi-tensor kernels on CPU and CUDA tensors.

    A drop-in replacement for ``apex.optimizers.FusedAdam`` (same arguments and defaults) and, with
    ``adam_w_mode=False`` / ``True``, for ``torch.optim.Adam`` / ``torch.optim.AdamW``: its state
    dict uses torch's keys and loads into ``torch.optim.AdamW`` and back.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate (a float, or a tensor when ``capturable``).
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator after the square root.
        adam_w_mode: decoupled weight decay (AdamW) when True, L2 regularisation (Adam) when False.
        weight_decay: weight decay coefficient.
        amsgrad: not supported; True raises RuntimeError.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        capturable: keep lr and step on the device and take GradScaler's ``found_inf`` and scale
            without a host sync (CUDA-graph safe step; grads are unscaled in place).
        master_weights: keep fp32 master copies of fp16/bf16 params; the kernel updates the master
            and writes the low-precision param in the same pass.
        maximize: maximize the objective (the kernel negates the grad, as torch.optim.Adam).
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        differentiable: must be False (True raises NotImplementedError).

    Raises:
        RuntimeError: ``amsgrad=True``; sparse grads; params of one group on several devices.
        TypeError: a param of a dtype other than fp32, fp16, bf16, fp64; a tuple passed
            positionally into ``bias_correction`` (torch's argument order instead of Apex's).
        ValueError: lr, eps or weight_decay negative, a beta outside [0, 1), any NaN.
        NotImplementedError: ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = adam.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = H.lr,
        bias_correction: bool = H.bias_correction,
        betas: tuple[float, float] = H.betas,
        eps: float = H.eps,
        adam_w_mode: bool = H.adam_w_mode,
        weight_decay: float = H.weight_decay,
        amsgrad: bool = H.amsgrad,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = adam.Hyperparams(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        check_torch_flags(
            type(self).__name__,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        super().__init__(
            params,
            hyper,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
            extra_defaults={"maximize": maximize},
        )

    def _group_tensors(self, group: dict, params: list) -> tuple:
        math_params, outs = self._masters(params)
        exp_avg, exp_avg_sq = self._state_tensors(params)
        return math_params, outs, exp_avg, exp_avg_sq

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        math_params, outs, exp_avg, exp_avg_sq = tensors
        device = grads[0].device
        scalars = self._amp_scalars(device)
        self._unscale_grads_in_place(grads, scalars, as_is)
        scalars.update(maximize_scale(group, device))
        step, lr = self._step_and_lr(group, device)
        adam.update(
            group, grads, math_params, exp_avg, exp_avg_sq, outs, step=step, lr=lr, as_is=as_is,
            **scalars,
        )  # fmt: skip
