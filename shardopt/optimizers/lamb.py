"""LAMB: the two-stage update rule and ``FusedLAMB`` (drop-in for apex.optimizers.FusedLAMB).

The math is ``csrc/optim/lamb_math.h``. Stage 1 (moments) and stage 2 (trust ratio and apply) are
separate calls so the per-tensor norms of the param and of the update term u can be summed across
shards in between: ``lamb_stage1_apply`` returns per-tensor sums of squares of p and u taken in
the moment pass, which ``DistributedFusedLAMB`` all-reduces and ``FusedLAMB`` uses as they are;
stage 2 takes their square roots and recomputes u from p, m and v instead of storing it. With the
grad-norm pass for clipping, a step reads and writes 44 bytes per fp32 param (40 with
``max_grad_norm=0``). ``FusedLAMB`` hands stage 1 the grads' sum of squares and lets the kernel
compute the clip factor, so a step is three kernel calls and no tensor op between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardopt import kernels as _ops
from shardopt.optimizers import dtensor
from shardopt.optimizers.fused_optimizer import (
    FusedOptimizer,
    check_torch_flags,
    reject_amsgrad,
)

STATE_NAMES = ("exp_avg", "exp_avg_sq")


def clip_scale(
    grad_norm: torch.Tensor, max_grad_norm: float, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The grad multiplier of LAMB's built-in clipping (docs/spec.md: no eps; 0: no clipping).

    ``grad_norm`` is the norm of the unscaled grads; the result stays on the device (no sync).
    """
    norm = grad_norm.reshape(1)
    if max_grad_norm > 0:
        factor = torch.where(norm > max_grad_norm, max_grad_norm / norm, torch.ones_like(norm))
    else:
        factor = torch.ones_like(norm)
    return factor if inv_scale is None else factor * inv_scale.reshape(1).to(factor.dtype)


def lamb_stage1_apply(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    *,
    step: int,
    grad_scale_t: torch.Tensor | None,
    grad_norm_sq_t: torch.Tensor | None = None,
    max_grad_norm: float = 0.0,
    as_is: bool = False,
    **scalars: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments; returns per-tensor sums of squares (of params, of update terms), same pass.

    ``params`` are read before the update (LAMB's ||w|| is taken before the step); the update
    term is not stored: stage 2 recomputes it from the moments. Every grad is multiplied by
    ``grad_scale_t`` and, given ``grad_norm_sq_t`` (the grads' sum of squares) and
    ``max_grad_norm > 0``, by the clip factor, which the kernel computes on the device
    (``clip_scale``'s rule and bits).
    """
    beta1, beta2 = group["betas"]
    return _ops.lamb_stage1(
        [grads, params, exp_avg, exp_avg_sq],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step=step,
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        grad_averaging=group["grad_averaging"],
        adam_w_mode=group["adam_w_mode"],
        grad_scale_t=grad_scale_t,
        step_t=scalars.get("step_t"),
        found_inf_t=scalars.get("found_inf_t"),
        **(
            {"grad_norm_sq_t": grad_norm_sq_t, "max_grad_norm": max_grad_norm}
            if grad_norm_sq_t is not None and max_grad_norm > 0
            else {}
        ),
        **_ops.as_is_kwargs(as_is),
    )


def lamb_stage2_apply(
    group: dict,
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    w_sq: torch.Tensor,
    u_sq: torch.Tensor,
    *,
    lr: float,
    step: int,
    as_is: bool = False,
    **scalars: torch.Tensor | None,
) -> None:
    """Trust ratio from the (fully reduced) per-tensor sums of squares, then the apply.

    The kernel takes the square roots of the sums; the update term is recomputed from ``params``
    and the moments stage 1 left, with the same ``step`` (or ``step_t``) and hyperparameters.
    """
    beta1, beta2 = group["betas"]
    _ops.lamb_stage2(
        [params, exp_avg, exp_avg_sq] + ([outs] if outs is not None else []),
        w_sq,
        u_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step=step,
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        adam_w_mode=group["adam_w_mode"],
        use_nvlamb=group["use_nvlamb"],
        lr_t=scalars.get("lr_t"),
        step_t=scalars.get("step_t"),
        found_inf_t=scalars.get("found_inf_t"),
        squared=True,
        **_ops.as_is_kwargs(as_is),
    )


class FusedLAMB(FusedOptimizer):
    """LAMB with fused multi-tensor kernels on CPU and CUDA tensors.

    A drop-in replacement for ``apex.optimizers.FusedLAMB``: the global grad norm over all groups
    clips the grads (``max_grad_norm``; 0 turns clipping off, where Apex's single-GPU kernel would
    zero every update), then each tensor's update is scaled by its trust ratio ``||w|| / ||u||``.
    Unlike Apex, state for fp16/bf16 params is kept in fp32. Do not clip grads again yourself.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: coefficients of the running averages.
        eps: added to the denominator after the square root.
        weight_decay: weight decay coefficient (decoupled when ``adam_w_mode``).
        amsgrad: not supported; True raises RuntimeError.
        adam_w_mode: decoupled weight decay (True) or L2 regularisation (False).
        grad_averaging: scale the grad by ``1 - beta1`` in the first moment.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        max_grad_norm: clip threshold of the global grad norm; 0 disables clipping.
        use_nvlamb: apply the trust ratio even to params with zero weight decay.
        capturable: keep lr and step on the device and take GradScaler's scale and found_inf
            without a host sync.
        master_weights: keep fp32 master copies of fp16/bf16 params.
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        maximize, differentiable: must be False (True raises NotImplementedError).

    Raises:
        RuntimeError: ``amsgrad=True``; sparse grads; params on several devices.
        TypeError: a param of an unsupported dtype; a tuple passed positionally into
            ``bias_correction`` (torch's argument order instead of Apex's).
        ValueError: lr, eps, weight_decay or max_grad_norm negative, a beta outside [0, 1), NaN.
        NotImplementedError: ``maximize=True`` or ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        capturable: bool = False,
        master_weights: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        reject_amsgrad(amsgrad, type(self).__name__)
        check_torch_flags(
            type(self).__name__,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
            maximize_supported=False,
        )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )
        super().__init__(
            params,
            defaults,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
        )
        # this step's sum of squares of all grads (for the clip factor stage 1 computes), set by
        # _before_step; a dict item, not an attribute: torch 2.11's Dynamo cannot trace a setattr
        # on the optimizer inside a compiled step
        self._step_tensors: dict[str, torch.Tensor] = {}

    def _before_step(self, work: list) -> None:
        if not work:
            return
        if len(work) > 1 and len({w.grads[0].device for w in work}) > 1:
            # the global grad norm spans every group
            all_params = [p for g in self.param_groups for p in g["params"]]
            _ops.check_param_devices(all_params, type(self).__name__)
        # max_grad_norm is read from the constructor defaults (Apex's behaviour); 0: no clipping,
        # and no pass over the grads for their norm
        if self.defaults["max_grad_norm"] <= 0:
            return
        grads = [g for w in work for g in w.grads]
        if all(w.plan is not None and w.plan.as_is for w in work):  # plain tensors
            total_sq, _ = _ops.norm(grads, as_is=True)
        elif dtensor.any_dtensor(grads):  # the norm of the full grads: shards' sums reduced
            _, per = _ops.norm(grads)
            total_sq = dtensor.reduce_per_tensor(per, grads).sum()
        else:
            total_sq, _ = _ops.norm(grads)
        self._step_tensors["grad_norm_sq_t"] = total_sq

    def _group_tensors(self, group: dict, params: list) -> tuple:
        math_params, outs = self._masters(params)
        exp_avg, exp_avg_sq = self._state_tensors(params)
        return math_params, outs, exp_avg, exp_avg_sq, dtensor.any_dtensor(math_params)

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        math_params, outs, exp_avg, exp_avg_sq, sharded = tensors
        device = grads[0].device
        scalars = self._device_scalars(group, device)
        grad_scale_t = scalars.pop("grad_scale_t", None)  # GradScaler's inverse scale
        max_grad_norm = self.defaults["max_grad_norm"]
        grad_norm_sq_t = self._step_tensors.get("grad_norm_sq_t") if max_grad_norm > 0 else None
        if grad_norm_sq_t is not None and grad_norm_sq_t.device != device:  # groups on devices
            grad_norm_sq_t = grad_norm_sq_t.to(device)
        step = self._step_scalar(group)
        w_sq, u_sq = lamb_stage1_apply(
            group,
            grads,
            math_params,
            exp_avg,
            exp_avg_sq,
            step=step,
            grad_scale_t=grad_scale_t,
            grad_norm_sq_t=grad_norm_sq_t,
            max_grad_norm=max_grad_norm,
            as_is=as_is,
            **scalars,
        )
        if sharded:  # ||w||, ||u|| of the full tensors
            n = len(math_params)
            both = dtensor.reduce_per_tensor(torch.cat([w_sq, u_sq]), list(math_params) * 2)
            w_sq, u_sq = both[:n], both[n:]
        lamb_stage2_apply(
            group,
            math_params,
            exp_avg,
            exp_avg_sq,
            outs,
            w_sq,
            u_sq,
            lr=self._lr_scalar(group),
            step=step,
            as_is=as_is,
            **scalars,
        )
