"""Adagrad: hyperparameters, the kernel's scalar arguments of a step, the update.

The math is ``csrc/optim/adagrad_math.h`` (torch.optim.Adagrad with ``lr_decay=0`` and
``initial_accumulator_value=0``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import hyperparams
from shardopt.algorithms.step_args import lr_args, update_device

STATE_NAMES = ("sum",)


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """Adagrad's hyperparameters with Apex's defaults. In Apex's positional order
    ``set_grad_none`` (a ``FusedAdagrad`` argument) comes before ``adagrad_w_mode``.

    Attributes:
        lr: learning rate.
        eps: added to the denominator after the square root.
        weight_decay: weight decay coefficient.
        adagrad_w_mode: decoupled weight decay (applied to the update) instead of L2.
    """

    lr: float | torch.Tensor = 1e-2
    eps: float = 1e-10
    weight_decay: float = 0.0
    adagrad_w_mode: bool = False


def kernel_args(group: dict, *, lr: float | torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The scalar arguments of the Adagrad kernel for one step of ``group``."""
    return dict(
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        adagrad_w_mode=group["adagrad_w_mode"],
        **lr_args(lr, device),
    )


def update(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    lr: float | torch.Tensor,
    grad_scale_t: torch.Tensor | None = None,
    found_inf_t: torch.Tensor | None = None,
    as_is: bool = False,
) -> None:
    """One Adagrad update of the given tensors (one kernel launch per dtype signature)."""
    kernels.adagrad(
        [grads, params, sums] + ([outs] if outs is not None else []),
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
        **kernel_args(group, lr=lr, device=update_device(params)),
        **kernels.as_is_kwargs(as_is),
    )
