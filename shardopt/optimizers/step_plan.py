"""Step plans: what a single-process optimizer's step keeps from one step to the next.

Note: step plans
The fused kernels take a whole param group in one launch, so on small tensors the step is bound
by the host work around that launch: looping over the params, building the tensor lists, looking
up state, grouping by dtype and layout. A ``GroupPlan`` keeps, per param group, what
the general path of the step worked out: the params that have grads, the tensors the kernels
take besides the grads (state, masters, low-precision outs) and whether those lists fit the
kernels as they are (shardopt/kernels/dispatch.py, Note: lists passed as they are). A later step
reuses it after checks that are C-level loops (``map``) over the group's params, never a
Python loop:

- the group dict and its ``params`` list hold the same objects (``add_param_group``, a group
  edited in place or ``param_groups`` replaced);
- the same params have grads (a grad that becomes None, or one that appears), none sparse;
- ``optimizer.state`` is the same object with the same per-param dicts, and none of those dicts
  was written since (``ParamState`` counts writes: a state tensor replaced or deleted, say);
- the class's ``_plan_key(group)`` is unchanged (e.g. SGD's momentum switched on or off) and,
  where fp32 masters are kept, every param keeps its dtype (it decides which params have one).

Anything else that can make the lists stale changes a tensor behind an unchanged object: a param
re-bound through ``p.data`` to another dtype, layout or device, a grad with other strides. The
kernels check every tensor before writing anything, so such a step is refused and fitted again
by ``shardopt.kernels`` exactly as the general path would; the lists themselves are the ones the
general path builds. ``load_state_dict`` and ``add_param_group`` drop every plan; a group that
fails its checks runs the general path, which plans it again. A plain dict put into
``optimizer.state`` by hand becomes a ``ParamState`` (a copy) at that group's next general step.
While Dynamo traces a step (``torch.compile``) the general path runs and nothing is planned; a
step captured in a CUDA graph runs whichever path holds at capture, host work only either way.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from itertools import compress, repeat
from typing import Any, NamedTuple

import torch

from shardopt import kernels as _ops

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_DTYPE = operator.attrgetter("dtype")


class StateWrites:
    """A counter of writes to the per-param state dicts of one optimizer."""

    def __init__(self) -> None:
        self.count = 0


class ParamState(dict):
    """One param's entry of ``optimizer.state``: a dict that counts its writes (Note: step plans).

    Reads cost what a dict's do; every write (``[k] = v``, ``del``, ``pop``, ``update``, ...)
    bumps the optimizer's ``StateWrites``, so a plan holding this dict's tensors is not reused.
    """

    __slots__ = ("_writes",)

    def __init__(self, writes: StateWrites, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writes = writes

    def _wrote(self) -> None:
        writes = getattr(self, "_writes", None)  # unset while unpickling fills the dict
        if writes is not None:
            writes.count += 1

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._wrote()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._wrote()

    def __ior__(self, other: Any) -> ParamState:
        super().__ior__(other)
        self._wrote()
        return self

    def clear(self) -> None:
        super().clear()
        self._wrote()

    def pop(self, *args: Any) -> Any:
        self._wrote()
        return super().pop(*args)

    def popitem(self) -> tuple[Any, Any]:
        self._wrote()
        return super().popitem()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._wrote()
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._wrote()


class GroupStep(NamedTuple):
    """One param group's share of a step: its params with grads, the grads and its plan."""

    index: int
    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    plan: GroupPlan | None


class GroupPlan:
    """What one param group's step reuses (see Note: step plans)."""

    __slots__ = ("group", "all_params", "with_grad", "params", "tensors", "as_is", "key", "dtypes")

    def __init__(self, step: GroupStep, tensors: tuple, key: Hashable, masters: bool) -> None:
        """``step`` went through the general path, which returned ``tensors``; ``key`` is the
        class's ``_plan_key``; ``masters``: params keep fp32 masters by dtype."""
        self.group = step.group
        self.all_params = list(step.group["params"])
        with_grad = [p.grad is not None for p in self.all_params]
        self.with_grad = None if all(with_grad) else with_grad
        self.params = step.params
        self.tensors = tensors
        lists = [step.grads] + [t for t in tensors if isinstance(t, list)]
        self.as_is = _ops.fits_as_is(lists)
        self.key = key
        self.dtypes = list(map(_DTYPE, step.params)) if masters else None

    def grads(self, group: dict, key: Hashable) -> list[torch.Tensor] | None:
        """This step's grads of the planned params, or None when the plan does not hold."""
        all_params = group["params"]
        if (
            group is not self.group
            or key != self.key
            or len(all_params) != len(self.all_params)
            or not all(map(operator.is_, all_params, self.all_params))
        ):
            return None
        grads = list(map(_GRAD, all_params))
        if self.with_grad is not None:
            if list(map(operator.is_not, grads, repeat(None))) != self.with_grad:
                return None
            grads = list(compress(grads, self.with_grad))
        try:
            if any(map(_IS_SPARSE, grads)):
                return None  # the general path raises the sparse-grad error
        except AttributeError:  # a grad that became None
            return None
        if self.dtypes is not None and list(map(_DTYPE, self.params)) != self.dtypes:
            return None
        return grads


class StepPlans:
    """The plans of one optimizer's param groups, and the state they were made against."""

    def __init__(self) -> None:
        self.by_group: dict[int, GroupPlan] = {}
        self.writes = StateWrites()
        self._state: Any = None  # optimizer.state when the plans were made
        self._state_writes = -1
        self._state_values: list[dict] = []

    def clear(self) -> None:
        self.by_group.clear()
        self._state = None

    def check_state(self, state: dict) -> None:
        """Drops every plan unless ``state`` is as it was when they were made."""
        if self.by_group and not (
            state is self._state
            and self.writes.count == self._state_writes
            and len(state) == len(self._state_values)
            and all(map(operator.is_, state.values(), self._state_values))
        ):
            self.clear()

    def reuse(self, index: int, group: dict, key: Hashable) -> GroupStep | None:
        """Group ``index``'s step from its plan, or None (the plan, if any, is dropped)."""
        plan = self.by_group.get(index)
        if plan is None:
            return None
        grads = plan.grads(group, key)
        if grads is None:
            del self.by_group[index]
            return None
        return GroupStep(index, group, plan.params, grads, plan)

    def add(self, index: int, plan: GroupPlan) -> None:
        self.by_group[index] = plan

    def seal(self, state: dict) -> None:
        """Records ``state`` as the plans' (after the step that made or used them)."""
        if self.by_group:
            self._state = state
            self._state_writes = self.writes.count
            self._state_values = list(state.values())
