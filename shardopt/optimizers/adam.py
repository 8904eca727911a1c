"""Adam / AdamW: the update rule and ``FusedAdam`` (drop-in for apex.optimizers.FusedAdam).

The math is ``csrc/optim/adam_math.h``; ``adam_apply`` is the one call into it, shared by
``FusedAdam`` and ``DistributedFusedAdam``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardopt import kernels as _ops
from shardopt.optimizers.fused_optimizer import (
    FusedOptimizer,
    check_torch_flags,
    maximize_scale,
    reject_amsgrad,
)

STATE_NAMES = ("exp_avg", "exp_avg_sq")


def adam_apply(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    step: int,
    lr: float,
    as_is: bool = False,
    **scalars: torch.Tensor | None,
) -> None:
    """One Adam update of the given tensors with ``group``'s hyperparameters (one kernel launch;
    ``as_is``: see Note: lists passed as they are, shardopt/kernels/dispatch.py)."""
    beta1, beta2 = group["betas"]
    _ops.adam(
        [grads, params, exp_avg, exp_avg_sq] + ([outs] if outs is not None else []),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step=step,
        adam_w_mode=group["adam_w_mode"],
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        **scalars,
        **_ops.as_is_kwargs(as_is),
    )


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

    state_names = STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        reject_amsgrad(amsgrad, "FusedAdam")
        check_torch_flags(
            "FusedAdam",
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            maximize=maximize,
        )
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
        )

    def _group_tensors(self, group: dict, params: list) -> tuple:
        math_params, outs = self._masters(params)
        exp_avg, exp_avg_sq = self._state_tensors(params)
        return math_params, outs, exp_avg, exp_avg_sq

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        math_params, outs, exp_avg, exp_avg_sq = tensors
        device = grads[0].device
        scalars = self._device_scalars(group, device)
        self._unscale_grads_in_place(grads, scalars, as_is)
        scalars.update(maximize_scale(group, device))
        adam_apply(
            group,
            grads,
            math_params,
            exp_avg,
            exp_avg_sq,
            outs,
            step=self._step_scalar(group),
            lr=self._lr_scalar(group),
            as_is=as_is,
            **scalars,
        )
