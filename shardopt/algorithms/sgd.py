"""SGD with momentum: hyperparameters, the kernel's scalar arguments of a step, the update.

The math is ``csrc/optim/sgd_math.h``, torch.optim.SGD's convention (``buf = momentum * buf +
(1 - dampening) * g``; the first update sets ``buf = g``: ``first_run``, or per call on the device
``first_run_t``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import hyperparams
from shardopt.algorithms.step_args import lr_args, update_device

STATE_NAMES = ("momentum_buffer",)

#: the default of ``lr``, which is required (as torch.optim.SGD's)
REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """SGD's hyperparameters with Apex's defaults, in Apex's positional order.

    Attributes:
        lr: learning rate (required).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        wd_after_momentum: apply weight decay after the momentum instead of before.
    """

    lr: float | torch.Tensor = REQUIRED  # type: ignore[assignment]
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    wd_after_momentum: bool = False

    def _check(self, owner: str) -> None:
        if self.lr is REQUIRED:  # the other checks are check_hyperparams'
            raise TypeError(f"{owner}.__init__() missing 1 required positional argument: 'lr'")


def kernel_args(
    group: dict, *, lr: float | torch.Tensor, first_run: bool, device: torch.device
) -> dict[str, Any]:
    """The scalar arguments of the SGD kernel for one step of ``group`` (``first_run``: the
    buffers start from the grads in this call)."""
    return dict(
        momentum=group["momentum"],
        dampening=group["dampening"],
        weight_decay=group["weight_decay"],
        nesterov=group["nesterov"],
        first_run=first_run,
        wd_after_momentum=group["wd_after_momentum"],
        **lr_args(lr, device),
    )


def update(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    first_run: bool,
    lr: float | torch.Tensor,
    scale: float = 1.0,
    first_run_t: torch.Tensor | None = None,
    grad_scale_t: torch.Tensor | None = None,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
) -> None:
    """One SGD update; ``first_run`` (or the device flag ``first_run_t``) initialises the
    momentum buffers to the grad (torch's rule); ``scale`` multiplies every grad (-1: maximize)."""
    kernels.sgd(
        [grads, params, momentum_buffers] + ([outs] if outs is not None else []),
        scale=scale,
        first_run_t=first_run_t,
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
        **kernel_args(group, lr=lr, first_run=first_run, device=update_device(params)),
        **kernels.as_is_kwargs(as_is),
    )
