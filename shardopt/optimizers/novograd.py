"""``FusedNovoGrad`` (drop-in for apex.optimizers.FusedNovoGrad): NovoGrad on the single-process
machinery.

The algorithm (hyperparameters, defaults, checks, the second-moment blend and dtype, the kernel
calls) is shardopt/algorithms/novograd.py, shared with ``DistributedFusedNovoGrad``; the math is
``csrc/optim/novograd_math.h``. The second moment is one number per tensor, kept as a norm, on a
small device vector (no host sync). ``FusedNovoGrad`` makes one kernel call per step
(``novograd.fused_step``): the per-tensor grad norms, the blend of that vector in place and the
per-element update. DTensor params all-reduce the norms first, then blend with
``novograd.blend_second_moment`` and update with ``novograd.update``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt import kernels as _ops
from shardopt.algorithms import novograd
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers import dtensor
from shardopt.optimizers.fused_optimizer import FusedOptimizer

H = novograd.Hyperparams  # the defaults below are the algorithm's


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad (per-tensor second moment) with fused kernels on CPU and CUDA tensors.

    A drop-in replacement for ``apex.optimizers.FusedNovoGrad``. The per-tensor second moments are
    kept as one vector per group in ``group["exp_avg_sq"]`` (Apex's layout): fp32, or fp64 for a
    group with fp64 params (so fp64 runs keep fp64 accuracy); ``load_state_dict`` moves it to the
    params' device and that dtype.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate.
        bias_correction: bias-correct both moments.
        betas: coefficients of the running averages.
        eps: added to the denominator.
        weight_decay: weight decay coefficient.
        amsgrad: not supported; True raises RuntimeError.
        reg_inside_moment: apply weight decay inside the first moment (Apex's moment_mode 0).
        grad_averaging: scale the grad by ``1 - beta1`` in the first moment.
        norm_type: 2 (L2) or 0 (infinity norm) for the per-tensor grad norm.
        init_zero: start the second moment at zero instead of the first grad norm.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        maximize, differentiable: must be False (True raises NotImplementedError).

    Raises:
        RuntimeError: ``norm_type`` other than 0 or 2; ``amsgrad=True``; sparse grads.
        TypeError: a param of an unsupported dtype; a tuple passed positionally into
            ``bias_correction`` (torch's argument order instead of Apex's).
        ValueError: lr, eps or weight_decay negative, a beta outside [0, 1), any NaN.
        NotImplementedError: ``maximize=True`` or ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedNovoGrad(model.parameters(), lr=1e-2, betas=(0.95, 0.98))
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = novograd.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = H.lr,
        bias_correction: bool = H.bias_correction,
        betas: tuple[float, float] = H.betas,
        eps: float = H.eps,
        weight_decay: float = H.weight_decay,
        amsgrad: bool = H.amsgrad,
        reg_inside_moment: bool = H.reg_inside_moment,
        grad_averaging: bool = H.grad_averaging,
        norm_type: int = H.norm_type,
        init_zero: bool = H.init_zero,
        set_grad_none: bool = True,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = novograd.Hyperparams(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            grad_averaging=grad_averaging,
            reg_inside_moment=reg_inside_moment,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        check_torch_flags(
            type(self).__name__,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
            maximize_supported=False,
        )
        super().__init__(params, hyper, set_grad_none=set_grad_none)

    def _plan_key(self, group: dict) -> int | None:
        second = group.get("exp_avg_sq")
        return second.numel() if torch.is_tensor(second) else None

    def _group_tensors(self, group: dict, params: list) -> tuple:
        """(params, exp_avg, positions of ``params`` in the group (None: all of them), the mask
        of params without state yet (None: none), whether any param is a DTensor)."""
        device = params[0].device
        all_params = group["params"]
        if not torch.is_tensor(group.get("exp_avg_sq")):
            dtype = _second_moment_dtype(all_params)
            group["exp_avg_sq"] = torch.zeros(len(all_params), dtype=dtype, device=device)
        pos = None  # all of them, in order
        if not len(params) == len(all_params) == group["exp_avg_sq"].numel():
            index = {id(p): i for i, p in enumerate(all_params)}
            pos = torch.tensor([index[id(p)] for p in params], device=device)
        fresh = None
        if any("exp_avg" not in self.state[p] for p in params):
            fresh = torch.tensor(["exp_avg" not in self.state[p] for p in params], device=device)
        (exp_avg,) = self._state_tensors(params)
        return params, exp_avg, pos, fresh, dtensor.any_dtensor(params)

    def _update_group(self, group: dict, params: list, grads: list) -> tuple | None:
        tensors = super()._update_group(group, params, grads)
        return tensors if tensors[3] is None else None  # planned once every param has state

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        params, exp_avg, pos, fresh, sharded = tensors
        if sharded:
            self._apply_sharded(group, grads, tensors, as_is)
            return
        second = group["exp_avg_sq"]
        v = second if pos is None else second.index_select(0, pos)
        step, lr = self._step_and_lr(group, grads[0].device)
        novograd.fused_step(group, grads, params, exp_avg, v, fresh, step=step, lr=lr, as_is=as_is)
        if pos is not None:  # the kernel blended a copy of the group's entries
            second.index_copy_(0, pos, v)

    def _apply_sharded(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        """DTensor params: norms of the full grads from the shards' partial ones, then the blend
        and the update of the local shards."""
        params, exp_avg, pos, fresh, _ = tensors
        device = grads[0].device
        max_norm = group["norm_type"] == 0
        _, per = _ops.norm(grads, max_norm=max_norm, as_is=as_is)
        per = dtensor.reduce_per_tensor(per, grads, "max" if max_norm else "sum")
        n = novograd.grad_norms(group["norm_type"], per.to(device))
        second = group["exp_avg_sq"]
        v = novograd.blend_second_moment(
            second if pos is None else second.index_select(0, pos),
            n,
            fresh,
            beta2=group["betas"][1],
            norm_type=group["norm_type"],
            init_zero=group["init_zero"],
        )
        step, lr = self._step_and_lr(group, device)
        novograd.update(group, grads, params, exp_avg, None, v, step=step, lr=lr, as_is=as_is)
        # stored after the kernel, which checks its lists first: a refused step changes nothing
        if pos is None:
            second.copy_(v)
        else:
            second.index_copy_(0, pos, v.to(second.dtype))

    def _after_load(self) -> None:
        for group in self.param_groups:
            if torch.is_tensor(group.get("exp_avg_sq")):
                group["exp_avg_sq"] = group["exp_avg_sq"].to(
                    device=group["params"][0].device, dtype=_second_moment_dtype(group["params"])
                )


def _second_moment_dtype(params: list) -> torch.dtype:
    """The algorithm's rule (``novograd.second_moment_dtype``) over the group's params, which the
    math updates directly (no masters): fp64 for an fp64 param, else fp32."""
    return novograd.second_moment_dtype(p.dtype for p in params)
