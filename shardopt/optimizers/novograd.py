"""NovoGrad: the update rule and ``FusedNovoGrad`` (drop-in for apex.optimizers.FusedNovoGrad).

The second moment is one number per tensor, kept as a norm, on a small device vector (no host
sync). ``FusedNovoGrad`` makes one kernel call per step (``_ops.novograd_step``): the per-tensor
grad norms, the blend of that vector in place and the per-element update
(``csrc/optim/novograd_math.h``). ``blend_second_moment`` (the same blend as torch ops) and
``novograd_apply`` (the update alone) serve ``DistributedFusedNovoGrad`` and DTensor params, whose
norms are all-reduced between the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from shardopt import kernels as _ops
from shardopt.optimizers import dtensor
from shardopt.optimizers.fused_optimizer import (
    FusedOptimizer,
    acc_dtype,
    check_torch_flags,
    reject_amsgrad,
)


def check_norm_type(norm_type: int) -> None:
    if norm_type not in (0, 2):
        raise RuntimeError(
            f"FusedNovoGrad only supports norm_type 2 (L2) and 0 (infinity norm), got {norm_type}"
        )


def grad_norms(norm_type: int, sq_or_max: torch.Tensor) -> torch.Tensor:
    """Per-tensor grad norms from the norm kernel's per-tensor output."""
    return sq_or_max.sqrt() if norm_type == 2 else sq_or_max


def blend_second_moment(
    v: torch.Tensor,
    n: torch.Tensor,
    fresh: torch.Tensor | None,
    *,
    beta2: float,
    norm_type: int,
    init_zero: bool,
) -> torch.Tensor:
    """New second moments from the old ``v``, grad norms ``n`` and the mask of first updates
    (None: no first update)."""
    v = v.to(n.dtype)
    if norm_type == 2:
        blended = torch.sqrt(beta2 * v * v + (1 - beta2) * n * n)
    else:
        blended = beta2 * v + (1 - beta2) * n
    if fresh is None:
        return blended
    if init_zero:
        start = math.sqrt(1 - beta2) * n if norm_type == 2 else (1 - beta2) * n
    else:
        start = n
    return torch.where(fresh, start, blended)


def novograd_apply(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    v: torch.Tensor,
    *,
    step: int,
    lr: float,
    as_is: bool = False,
    **scalars: torch.Tensor | None,
) -> None:
    """One NovoGrad update given the blended per-tensor second moments ``v``."""
    beta1, beta2 = group["betas"]
    _ops.novograd(
        [grads, params, exp_avg] + ([outs] if outs is not None else []),
        v,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step=step,
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        grad_averaging=group["grad_averaging"],
        moment_mode=0 if group["reg_inside_moment"] else 1,
        **scalars,
        **_ops.as_is_kwargs(as_is),
    )


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

    state_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        reject_amsgrad(amsgrad, "FusedNovoGrad")
        check_torch_flags(
            "FusedNovoGrad",
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
            maximize_supported=False,
        )
        check_norm_type(norm_type)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            reg_inside_moment=reg_inside_moment,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(params, defaults, set_grad_none=set_grad_none)

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
        beta1, beta2 = group["betas"]
        _ops.novograd_step(
            [grads, params, exp_avg],
            v,
            fresh,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=self._step_scalar(group),
            bias_correction=group["bias_correction"],
            weight_decay=group["weight_decay"],
            grad_averaging=group["grad_averaging"],
            moment_mode=0 if group["reg_inside_moment"] else 1,
            norm_type=group["norm_type"],
            init_zero=group["init_zero"],
            **self._lr_args(group, grads[0].device),
            **_ops.as_is_kwargs(as_is),
        )
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
        n = grad_norms(group["norm_type"], per.to(device))
        second = group["exp_avg_sq"]
        v = blend_second_moment(
            second if pos is None else second.index_select(0, pos),
            n,
            fresh,
            beta2=group["betas"][1],
            norm_type=group["norm_type"],
            init_zero=group["init_zero"],
        )
        novograd_apply(
            group,
            grads,
            params,
            exp_avg,
            None,
            v,
            step=self._step_scalar(group),
            as_is=as_is,
            **self._lr_args(group, grads[0].device),
        )
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
    """fp64 when the group has an fp64 param, else fp32 (``acc_dtype`` over the group)."""
    return (
        torch.float64
        if any(acc_dtype(p.dtype) == torch.float64 for p in params)
        else (torch.float32)
    )
