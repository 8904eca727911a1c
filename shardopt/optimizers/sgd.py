"""``FusedSGD`` (drop-in for apex.optimizers.FusedSGD): SGD with momentum on the single-process
machinery.

The algorithm (hyperparameters, defaults, checks, the kernel call) is shardopt/algorithms/sgd.py,
shared with ``DistributedFusedSGD``; the math is ``csrc/optim/sgd_math.h``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt.algorithms import sgd
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers.fused_optimizer import FusedOptimizer

H = sgd.Hyperparams  # the defaults below are the algorithm's


class FusedSGD(FusedOptimizer):
    """SGD with momentum, nesterov and weight decay, fused over many tensors (CPU and CUDA).

    A drop-in replacement for ``apex.optimizers.FusedSGD`` and ``torch.optim.SGD`` (same momentum
    convention: ``buf = momentum * buf + (1 - dampening) * g``; the first step sets ``buf = g``).
    The momentum buffer has the param's dtype, as in both; for fp16/bf16 params the update rounds
    to that dtype where ``torch.optim.SGD(foreach=False)``'s tensor ops round, so it gives torch's
    bits (docs/spec.md "FusedSGD").

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate (required).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        wd_after_momentum: apply weight decay after the momentum instead of before.
        materialize_master_grads: accepted for Apex compatibility; no effect (no masters are kept).
        set_grad_none: default of ``zero_grad``'s ``set_to_none`` (False, as Apex).
        maximize: maximize the objective (the grad is negated in the kernel, as torch.optim.SGD).
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        differentiable: must be False (True raises NotImplementedError).

    Raises:
        TypeError: missing ``lr``; a param of an unsupported dtype.
        ValueError: a negative lr, momentum or weight decay, any NaN; nesterov without momentum.
        NotImplementedError: ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = sgd.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = H.lr,
        momentum: float = H.momentum,
        dampening: float = H.dampening,
        weight_decay: float = H.weight_decay,
        nesterov: bool = H.nesterov,
        wd_after_momentum: bool = H.wd_after_momentum,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = sgd.Hyperparams(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )
        check_torch_flags(
            type(self).__name__,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        self.materialize_master_grads = materialize_master_grads
        super().__init__(
            params, hyper, set_grad_none=set_grad_none, extra_defaults={"maximize": maximize}
        )

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The param's dtype, as torch.optim.SGD and Apex's FusedSGD keep the momentum buffer; for
        fp16/bf16 params the kernel also rounds where torch.optim.SGD's tensor ops round."""
        return p.dtype

    def _plan_key(self, group: dict) -> bool:
        return group["momentum"] == 0  # without momentum the param stands in for the buffer

    def _group_tensors(self, group: dict, params: list) -> tuple:
        if group["momentum"] == 0:
            return params, params
        return params, *self._state_tensors(params)

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        params, bufs = tensors
        self._sgd(group, grads, params, bufs, first_run=False, as_is=as_is)

    def _update_group(self, group: dict, params: list, grads: list) -> tuple | None:
        if group["momentum"] == 0:
            return super()._update_group(group, params, grads)
        # torch's rule: a param without a buffer starts it from its grad this step.
        fresh = [p for p in params if "momentum_buffer" not in self.state[p]]
        if not fresh:
            return super()._update_group(group, params, grads)
        seen = [p for p in params if "momentum_buffer" in self.state[p]]
        for first_run, subset in ((True, fresh), (False, seen)):
            if subset:
                (bufs,) = self._state_tensors(subset)
                self._sgd(group, [p.grad for p in subset], subset, bufs, first_run=first_run)
        return None  # planned at the next step, when every buffer exists

    def _sgd(
        self, group: dict, grads: list, params: list, bufs: list, first_run: bool, as_is=False
    ) -> None:
        sgd.update(
            group,
            grads,
            params,
            bufs,
            None,
            first_run=first_run,
            lr=group["lr"],
            scale=-1.0 if group.get("maximize", False) else 1.0,
            as_is=as_is,
        )
