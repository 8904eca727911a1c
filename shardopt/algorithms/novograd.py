"""NovoGrad: hyperparameters, the per-tensor second moment, the kernels' scalar arguments, the
update.

The second moment is one number per tensor, kept as a norm (docs/spec.md "FusedNovoGrad"). Its
blend is one rule: ``csrc/optim/novograd_math.h`` (``Blend``) inside the ``novograd_step``
kernel (``fused_step``), which ``FusedNovoGrad`` calls on plain tensors, and
``blend_second_moment`` here, the same rule as torch ops, for the callers that all-reduce the
per-tensor norms between the norm pass and the update (``DistributedFusedNovoGrad``, DTensor
params). Its dtype is ``second_moment_dtype`` of what the math updates: fp64 for fp64 params,
else fp32 (the ZeRO class updates fp32 masters, also for fp64 params, so its vector is fp32).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import hyperparams
from shardopt.algorithms.step_args import lr_args, step_args, update_device
from shardopt.algorithms.validation import reject_amsgrad

STATE_NAMES = ("exp_avg",)


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """NovoGrad's hyperparameters with Apex's defaults (in the order of the param-group entries;
    Apex's positional order has ``reg_inside_moment`` before ``grad_averaging``).

    Attributes:
        lr: learning rate.
        bias_correction: bias-correct both moments.
        betas: coefficients of the running averages.
        eps: added to the denominator.
        weight_decay: weight decay coefficient.
        amsgrad: not supported; True raises RuntimeError (not a param-group entry).
        grad_averaging: scale the grad by ``1 - beta1`` in the first moment.
        reg_inside_moment: apply weight decay inside the first moment (Apex's moment_mode 0).
        norm_type: 2 (L2) or 0 (infinity norm) for the per-tensor grad norm.
        init_zero: start the second moment at zero instead of the first grad norm.
    """

    lr: float | torch.Tensor = 1e-3
    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = hyperparams.constructor_only(False)
    grad_averaging: bool = True
    reg_inside_moment: bool = False
    norm_type: int = 2
    init_zero: bool = False

    def _check(self, owner: str) -> None:
        reject_amsgrad(self.amsgrad, owner)
        if self.norm_type not in (0, 2):
            raise RuntimeError(
                f"{owner} only supports norm_type 2 (L2) and 0 (infinity norm), got "
                f"{self.norm_type}"
            )


def second_moment_dtype(math_dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of the second-moment vector: fp64 when any param the math updates (a param, or
    its master) is fp64, else fp32."""
    return torch.float64 if any(d == torch.float64 for d in math_dtypes) else torch.float32


def grad_norms(norm_type: int, sq_or_max: torch.Tensor) -> torch.Tensor:
    """Per-tensor grad norms from the norm kernel's per-tensor output (sums of squares for L2,
    maxima for the infinity norm), fully reduced across shards."""
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
    (None: no first update); the kernel's ``Blend`` as torch ops."""
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


def kernel_args(
    group: dict, *, step: int | torch.Tensor, lr: float | torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """The scalar arguments of the NovoGrad element update (``novograd``; ``novograd_step`` adds
    ``norm_type`` and ``init_zero``) for one step of ``group``."""
    beta1, beta2 = group["betas"]
    return dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        grad_averaging=group["grad_averaging"],
        moment_mode=0 if group["reg_inside_moment"] else 1,
        **step_args(step, device),
        **lr_args(lr, device),
    )


def update(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    v: torch.Tensor,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    grad_scale_t: torch.Tensor | None = None,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
) -> None:
    """One NovoGrad element update given the blended per-tensor second moments ``v``."""
    kernels.novograd(
        [grads, params, exp_avg] + ([outs] if outs is not None else []),
        v,
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
        **kernel_args(group, step=step, lr=lr, device=update_device(params)),
        **kernels.as_is_kwargs(as_is),
    )


def fused_step(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    v: torch.Tensor,
    fresh: torch.Tensor | None,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    as_is: bool = False,
) -> None:
    """The whole step in one kernel call: the per-tensor grad norms, the blend of ``v`` in place
    (``fresh``: the mask of first updates) and the element update with the new ``v``."""
    kernels.novograd_step(
        [grads, params, exp_avg],
        v,
        fresh,
        norm_type=group["norm_type"],
        init_zero=group["init_zero"],
        **kernel_args(group, step=step, lr=lr, device=update_device(params)),
        **kernels.as_is_kwargs(as_is),
    )
