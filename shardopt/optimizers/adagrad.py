"""``FusedAdagrad`` (drop-in for apex.optimizers.FusedAdagrad): Adagrad on the single-process
machinery.

The algorithm (hyperparameters, defaults, checks, the kernel call) is
shardopt/algorithms/adagrad.py, shared with ``DistributedFusedAdagrad``; the math is
``csrc/optim/adagrad_math.h``.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardopt.algorithms import adagrad
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers.fused_optimizer import FusedOptimizer, maximize_scale

H = adagrad.Hyperparams  # the defaults below are the algorithm's


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

    state_names = adagrad.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = H.lr,
        eps: float = H.eps,
        weight_decay: float = H.weight_decay,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = H.adagrad_w_mode,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = adagrad.Hyperparams(
            lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode
        )
        check_torch_flags(
            type(self).__name__,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        super().__init__(
            params, hyper, set_grad_none=set_grad_none, extra_defaults={"maximize": maximize}
        )

    def _group_tensors(self, group: dict, params: list) -> tuple:
        return params, *self._state_tensors(params)

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        params, sums = tensors
        scalars = maximize_scale(group, grads[0].device)
        adagrad.update(group, grads, params, sums, None, lr=group["lr"], as_is=as_is, **scalars)
