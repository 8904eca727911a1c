"""LAMB: hyperparameters, the kernels' scalar arguments of a step, the two-stage update.

The math is ``csrc/optim/lamb_math.h``. Stage 1 (moments) and stage 2 (trust ratio and apply)
are separate calls so the per-tensor norms of the param and of the update term u can be summed
across shards in between: ``stage1`` returns per-tensor sums of squares of p and u taken in the
moment pass, which ``DistributedFusedLAMB`` all-reduces and ``FusedLAMB`` uses as they are;
``stage2`` takes their square roots and recomputes u from p, m and v instead of storing it.

The built-in clipping is one rule for both classes: the constructor's ``max_grad_norm`` (Apex
reads it from there, not from the group; ``clips``: 0 turns it off, and no grad norm is taken),
and stage 1 computes the clip factor from the grads' sum of squares on the device
(``lamb::clip_scale``: no eps), times the grad scale it is given (averaging, inverse loss scale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import hyperparams
from shardopt.algorithms.step_args import lr_args, step_args, update_device
from shardopt.algorithms.validation import reject_amsgrad

STATE_NAMES = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """LAMB's hyperparameters with Apex's defaults (in the order of the param-group entries;
    Apex's positional order has ``adam_w_mode`` before ``grad_averaging``).

    Attributes:
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: coefficients of the running averages.
        eps: added to the denominator after the square root.
        weight_decay: weight decay coefficient (decoupled when ``adam_w_mode``).
        amsgrad: not supported; True raises RuntimeError (not a param-group entry).
        grad_averaging: scale the grad by ``1 - beta1`` in the first moment.
        adam_w_mode: decoupled weight decay (True) or L2 regularisation (False).
        max_grad_norm: clip threshold of the global grad norm; 0 disables clipping.
        use_nvlamb: apply the trust ratio even to params with zero weight decay.
    """

    lr: float | torch.Tensor = 1e-3
    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    amsgrad: bool = hyperparams.constructor_only(False)
    grad_averaging: bool = True
    adam_w_mode: bool = True
    max_grad_norm: float = 1.0
    use_nvlamb: bool = False

    def _check(self, owner: str) -> None:
        reject_amsgrad(self.amsgrad, owner)


def clips(max_grad_norm: float) -> bool:
    """Whether the built-in clipping is on (``max_grad_norm > 0``): only then is the global grad
    norm taken, and stage 1 given it."""
    return max_grad_norm > 0


def stage1_args(
    group: dict,
    *,
    step: int | torch.Tensor,
    device: torch.device,
    grad_norm_sq_t: torch.Tensor | None,
    max_grad_norm: float,
) -> dict[str, Any]:
    """The scalar arguments of ``lamb_stage1`` for one step of ``group``: its hyperparameters, the
    step of the bias corrections and, when clipping (``clips``) with the grads' sum of squares
    ``grad_norm_sq_t``, the clipping threshold the kernel computes the factor from."""
    beta1, beta2 = group["betas"]
    clip = grad_norm_sq_t is not None and clips(max_grad_norm)
    return dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        grad_averaging=group["grad_averaging"],
        adam_w_mode=group["adam_w_mode"],
        **step_args(step, device),
        **({"grad_norm_sq_t": grad_norm_sq_t, "max_grad_norm": max_grad_norm} if clip else {}),
    )


def stage2_args(
    group: dict, *, step: int | torch.Tensor, lr: float | torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """The scalar arguments of ``lamb_stage2`` for one step of ``group``: the hyperparameters of
    the update term it recomputes and of the trust ratio, the step and the lr."""
    beta1, beta2 = group["betas"]
    return dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        adam_w_mode=group["adam_w_mode"],
        use_nvlamb=group["use_nvlamb"],
        **step_args(step, device),
        **lr_args(lr, device),
    )


def stage1(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    *,
    step: int | torch.Tensor,
    grad_scale_t: torch.Tensor | None = None,
    grad_norm_sq_t: torch.Tensor | None = None,
    max_grad_norm: float = 0.0,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
    cuda_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments; returns per-tensor sums of squares (of params, of update terms), same pass.

    ``params`` are read before the update (LAMB's ||w|| is taken before the step); the update
    term is not stored: stage 2 recomputes it from the moments. Every grad is multiplied by
    ``grad_scale_t`` and, given ``grad_norm_sq_t`` (the sum of squares of the grads as given) and
    ``max_grad_norm > 0``, by the clip factor, which the kernel computes on the device.
    ``cuda_order``: on CPU tensors, the sums in the CUDA kernel's order, so that they have its
    bits (the CPU update of an offloaded shard on a CUDA job).
    """
    args = stage1_args(
        group,
        step=step,
        device=update_device(params),
        grad_norm_sq_t=grad_norm_sq_t,
        max_grad_norm=max_grad_norm,
    )
    return kernels.lamb_stage1(
        [grads, params, exp_avg, exp_avg_sq],
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
        **args,
        **({"cuda_order": True} if cuda_order else {}),
        **kernels.as_is_kwargs(as_is),
    )


def stage2(
    group: dict,
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    w_sq: torch.Tensor,
    u_sq: torch.Tensor,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
) -> None:
    """Trust ratio from the (fully reduced) per-tensor sums of squares, then the apply.

    The kernel takes the square roots of the sums; the update term is recomputed from ``params``
    and the moments stage 1 left, with the same ``step`` and hyperparameters.
    """
    kernels.lamb_stage2(
        [params, exp_avg, exp_avg_sq] + ([outs] if outs is not None else []),
        w_sq,
        u_sq,
        found_inf_t=found_inf_t,
        squared=True,
        **stage2_args(group, step=step, lr=lr, device=update_device(params)),
        **kernels.as_is_kwargs(as_is),
    )
