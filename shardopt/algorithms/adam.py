"""Adam / AdamW: hyperparameters, the kernel's scalar arguments of a step, the update.

The math is ``csrc/optim/adam_math.h`` (compact state: ``adam_compact_math.h``). ``FusedAdam``
and ``DistributedFusedAdam`` take ``Hyperparams``' defaults and checks and call ``update`` (the
distributed class's compact storage calls ``shardopt.kernels.adam_compact`` with ``kernel_args``).
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
#: whether each state takes negative values (the 8-bit quantisation map of compact storage)
STATE_SIGNED = {"exp_avg": True, "exp_avg_sq": False}


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """Adam's hyperparameters with Apex's defaults, in Apex's positional order.

    Attributes:
        lr: learning rate (a float, or a 1-element tensor read on the device).
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator after the square root.
        adam_w_mode: decoupled weight decay (AdamW) when True, L2 regularisation (Adam) when False.
        weight_decay: weight decay coefficient.
        amsgrad: not supported; True raises RuntimeError (not a param-group entry).
    """

    lr: float | torch.Tensor = 1e-3
    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    adam_w_mode: bool = True
    weight_decay: float = 0.0
    amsgrad: bool = hyperparams.constructor_only(False)

    def _check(self, owner: str) -> None:
        reject_amsgrad(self.amsgrad, owner)


def kernel_args(
    group: dict, *, step: int | torch.Tensor, lr: float | torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """The scalar arguments of the Adam kernels (``adam``, ``adam_compact``) for one step of
    ``group``: its hyperparameters, the step of the bias corrections and the lr (host numbers, or
    tensors handed over on ``device``: shardopt/algorithms/step_args.py)."""
    beta1, beta2 = group["betas"]
    return dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        adam_w_mode=group["adam_w_mode"],
        bias_correction=group["bias_correction"],
        weight_decay=group["weight_decay"],
        **step_args(step, device),
        **lr_args(lr, device),
    )


def update(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    step: int | torch.Tensor,
    lr: float | torch.Tensor,
    grad_scale_t: torch.Tensor | None = None,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
) -> None:
    """One Adam update of the given tensors with ``group``'s hyperparameters (one kernel launch
    per dtype signature; ``outs``: the rounded params written beside fp32 masters; ``as_is``: see
    Note: lists passed as they are, shardopt/kernels/dispatch.py)."""
    kernels.adam(
        [grads, params, exp_avg, exp_avg_sq] + ([outs] if outs is not None else []),
        **kernel_args(group, step=step, lr=lr, device=update_device(params)),
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
        **kernels.as_is_kwargs(as_is),
    )
