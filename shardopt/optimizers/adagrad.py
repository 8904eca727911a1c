"""Adagrad: the update rule and ``FusedAdagrad`` (drop-in for apex.optimizers.FusedAdagrad).

The math is ``csrc/optim/adagrad_math.h``; ``adagrad_apply`` is shared by ``FusedAdagrad`` and
``DistributedFusedAdagrad``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardopt import kernels as _ops
from shardopt.optimizers.fused_optimizer import FusedOptimizer, check_torch_flags, maximize_scale


def adagrad_apply(
    group: dict,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    lr: float,
    as_is: bool = False,
    **scalars: torch.Tensor | None,
) -> None:
    """One Adagrad update of the given tensors (one kernel launch per dtype signature)."""
    _ops.adagrad(
        [grads, params, sums] + ([outs] if outs is not None else []),
        lr=lr,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        adagrad_w_mode=group["adagrad_w_mode"],
        **scalars,
        **_ops.as_is_kwargs(as_is),
    )


class FusedAdagrad(FusedOptimizer):
    """Adagrad fused over many tensors (CPU and CUDA).

    A drop-in replacement for ``apex.optimizers.FusedAdagrad`` and for ``torch.optim.Adagrad`` with
    ``lr_decay=0`` and ``initial_accumulator_value=0`` (state key ``sum``).

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate.
        eps: added to the denominator after the square root.
        weight_decay: weight decay coefficient.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        adagrad_w_mode: decoupled weight decay (applied to the update) instead of L2.
        maximize: maximize the objective (the grad is negated in the kernel, as
            torch.optim.Adagrad).
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        differentiable: must be False (True raises NotImplementedError).

    Raises:
        TypeError: a param of an unsupported dtype.
        ValueError: a negative lr, eps or weight decay, any NaN.
        RuntimeError: sparse grads.
        NotImplementedError: ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedAdagrad(model.parameters(), lr=1e-2)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = ("sum",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        check_torch_flags(
            "FusedAdagrad",
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            adagrad_w_mode=adagrad_w_mode,
            maximize=maximize,
        )
        super().__init__(params, defaults, set_grad_none=set_grad_none)

    def _group_tensors(self, group: dict, params: list) -> tuple:
        return params, *self._state_tensors(params)

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        params, sums = tensors
        scalars = maximize_scale(group, grads[0].device)
        adagrad_apply(
            group,
            grads,
            params,
            sums,
            None,
            as_is=as_is,
            **self._lr_args(group, grads[0].device),
            **scalars,
        )
