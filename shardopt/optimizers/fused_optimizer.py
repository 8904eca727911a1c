"""The base of every single-process fused optimizer: validation, step protocol, state dict.

Subclasses hand their algorithm's ``Hyperparams`` (shardopt/algorithms/) to ``__init__``, which
validates them and makes the param-group defaults, and implement ``_group_tensors(group, params)``
(the tensors their kernels take besides the grads: state, masters, outs; created on first use)
and ``_apply(group, grads, tensors, as_is)`` (the calls of their algorithm's update); the step
keeps the first per group in a plan (see Note: step plans in step_plan.py). Everything users see
in common (the deprecated Apex step arguments, closures, ``zero_grad``, GradScaler hand-off,
``add_param_group``) lives here once, and the torch.optim-compatible state dict with its hooks in
``TorchStateDict`` (state_dict.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardopt import kernels as _ops
from shardopt.algorithms.hyperparams import Hyperparams
from shardopt.algorithms.step_args import device_lr
from shardopt.optimizers.dtensor import check_param_types
from shardopt.optimizers.masters import ParamVersions
from shardopt.optimizers.state_dict import TorchStateDict
from shardopt.optimizers.step_plan import GroupPlan, GroupStep, ParamState, StepPlans

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer state and math use for params of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_param_dtypes(param_groups: list[dict], owner: str, first_index: int = 0) -> None:
    """Raises TypeError naming the first param (global index) of an unsupported dtype."""
    index = first_index
    for group in param_groups:
        for p in group["params"]:
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{owner} supports float32, float16, bfloat16 and float64 params; param "
                    f"{index} has dtype {p.dtype}"
                )
            index += 1


def check_grad(p: torch.Tensor, owner: str) -> None:
    """Rejects sparse grads with the torch.optim.SparseAdam hint."""
    if p.grad.is_sparse:
        raise RuntimeError(
            f"{owner} does not support sparse gradients, please consider torch.optim.SparseAdam "
            "instead"
        )


def maximize_scale(group: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """``grad_scale_t=-1`` for a ``maximize`` group (the kernels multiply every grad element by
    it, so the update ascends), else nothing. Made on the device: no host-to-device copy."""
    if not group.get("maximize", False):
        return {}
    return {"grad_scale_t": torch.full((1,), -1.0, dtype=torch.float32, device=device)}


class FusedOptimizer(TorchStateDict, torch.optim.Optimizer):
    """Common machinery of the fused single-process optimizers (not used directly)."""

    #: per-element state tensors of the update rule, in kernel slot order
    state_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable,
        hyper: Hyperparams,
        *,
        set_grad_none: bool,
        capturable: bool = False,
        master_weights: bool = False,
        extra_defaults: dict[str, Any] | None = None,
    ) -> None:
        """``hyper``: the algorithm's hyperparameters, validated here (torch.optim's checks);
        its param-group entries and ``extra_defaults`` (e.g. ``maximize``) are the defaults."""
        hyper.validate(type(self).__name__)
        super().__init__(params, hyper.group_defaults() | (extra_defaults or {}))
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``: missing hyperparameters come from the constructor's
        defaults; the group's ``step`` starts at 0 and its state is created at its first update."""
        first = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_param_types(group["params"], type(self).__name__, first_index=first)
        check_param_dtypes([group], type(self).__name__, first_index=first)
        group.setdefault("step", 0)
        self._plans().clear()

    # GradScaler hands grad_scale/found_inf to the optimizer (no host sync) only when capturable.
    @property
    def _step_supports_amp_scaling(self) -> bool:  # read by torch.amp.GradScaler
        return self.capturable

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears grads; ``set_to_none`` defaults to the ``set_grad_none`` constructor flag."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
    ) -> Any:
        """Performs one update of every param that has a grad; returns the closure's loss."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(
                f"{type(self).__name__} has been updated. Simply initialize it identically to "
                "torch.optim.Adam, and call step() with no arguments."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        planning = not torch.compiler.is_compiling()  # Dynamo traces the general path
        plans = self._plans()
        work = self._collect(plans if planning else None)
        # a compiled step does not follow writes (Dynamo traces no version counters; see the Note)
        following = self.master_weights and not torch.compiler.is_compiling()
        versions = self._versions() if following else None
        if versions is not None:  # see Note: the params are the truth, masters.py
            for w in work:
                versions.follow(self.state, w.params, self._keeps_master)
        self._before_step(work)
        for w in work:
            self._advance_step(w.group, w.grads[0].device)
            if w.plan is not None:
                self._apply(w.group, w.grads, w.plan.tensors, w.plan.as_is)
                continue
            tensors = self._update_group(w.group, w.params, w.grads)
            if planning and tensors is not None:
                key = self._plan_key(w.group)
                plans.add(w.index, GroupPlan(w, tensors, key, masters=self.master_weights))
        if planning and any(w.plan is None for w in work):  # the state may have been written
            plans.seal(self.state)
        if versions is not None:
            for w in work:
                versions.record(self.state, w.params)
        return loss

    def _versions(self) -> ParamVersions:
        versions = self.__dict__.get("_param_versions")  # absent after torch.optim's __setstate__
        if versions is None:
            versions = self._param_versions = ParamVersions()
        return versions

    def _plans(self) -> StepPlans:
        plans = self.__dict__.get("_step_plans")  # absent after torch.optim's __setstate__
        if plans is None:
            plans = self._step_plans = StepPlans()
        return plans

    def _collect(self, plans: StepPlans | None) -> list[GroupStep]:
        """Each group with grads: its params with grads, the grads, and its plan if it holds."""
        if plans is not None:
            plans.check_state(self.state)
        owner = type(self).__name__
        work = []
        first = 0
        for index, group in enumerate(self.param_groups):
            first, start = first + len(group["params"]), first
            if plans is not None:
                planned = plans.reuse(index, group, self._plan_key(group))
                if planned is not None:
                    work.append(planned)
                    continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                check_grad(p, owner)
            _ops.check_param_devices(group["params"], owner, first_index=start)
            work.append(GroupStep(index, group, params, [p.grad for p in params], None))
        return work

    # -- hooks for subclasses -------------------------------------------------------------------

    def _before_step(self, work: list[GroupStep]) -> None:
        """Work across all groups before the per-group updates (LAMB's global grad norm)."""

    def _group_tensors(self, group: dict, params: list) -> tuple:
        """The tensors the kernels take besides the grads (lists in slot order), created on first
        use; kept in the group's plan while it holds (see Note: step plans)."""
        raise NotImplementedError

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        """The kernel calls of one group's update (``as_is``: see Note: lists passed as they are,
        shardopt/kernels/dispatch.py)."""
        raise NotImplementedError

    def _update_group(self, group: dict, params: list, grads: list) -> tuple | None:
        """The general path of one group's update; returns the tensors to plan the next step with
        (None: plan again next step)."""
        tensors = self._group_tensors(group, params)
        self._apply(group, grads, tensors, as_is=False)
        return tensors

    def _plan_key(self, group: dict) -> Any:
        """What a group's tensors depend on besides its params, state and their dtypes."""
        return self.master_weights

    # -- step counter, device scalars, masters ---------------------------------------------------

    def _advance_step(self, group: dict, device: torch.device) -> None:
        if self.capturable:
            if not torch.is_tensor(group["step"]):
                group["step"] = torch.tensor(float(group["step"]), device=device)
            found_inf = self._found_inf()
            if found_inf is None:
                group["step"].add_(1)
            else:
                group["step"].add_(1 - found_inf.to(group["step"].device).reshape(()))
        else:
            group["step"] += 1

    def _found_inf(self) -> torch.Tensor | None:
        """GradScaler's found_inf flag (capturable hand-off), as an fp32 device scalar."""
        found_inf = getattr(self, "found_inf", None)
        return None if found_inf is None else found_inf.float().reshape(1)

    def _step_and_lr(self, group: dict, device: torch.device) -> tuple[Any, Any]:
        """The step and lr an algorithm's update takes (shardopt/algorithms/step_args.py): when
        capturable both as device tensors (read there: no host sync, nothing baked into a captured
        graph), else the group's host step and its lr as it is (a tensor lr is read on the
        device)."""
        if self.capturable:
            return group["step"], device_lr(group["lr"], device)
        return group["step"], group["lr"]

    def _amp_scalars(self, device: torch.device) -> dict[str, torch.Tensor]:
        """GradScaler's inverse scale (``grad_scale_t``) and ``found_inf_t``, handed to a
        capturable optimizer as device tensors (nothing when not capturable)."""
        if not self.capturable:
            return {}
        scalars = {}
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = self._found_inf()
        if grad_scale is not None:
            scalars["grad_scale_t"] = grad_scale.to(device).float().reciprocal().reshape(1)
        if found_inf is not None:
            scalars["found_inf_t"] = found_inf.to(device)
        return scalars

    def _unscale_grads_in_place(self, grads: list, scalars: dict, as_is: bool) -> None:
        """Capturable AMP: grads are unscaled in place, so the kernel sees a scale of 1."""
        grad_scale_t = scalars.pop("grad_scale_t", None)
        if grad_scale_t is not None:
            flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            _ops.scale(grads, grads, flag, scale_t=grad_scale_t, as_is=as_is)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of ``p``'s per-element state (docs/spec.md "State dtypes")."""
        return acc_dtype(p.dtype)

    def _state_tensors(self, params: list) -> list[list[torch.Tensor]]:
        """Per-element state of each param (created as zeros on first use), in slot order.

        State takes the param's layout (``zeros_like``'s preserve_format, as torch.optim's).
        """
        out: list[list[torch.Tensor]] = [[] for _ in self.state_names]
        for p in params:
            state = self._param_state(p)
            for k, name in enumerate(self.state_names):
                if name not in state:
                    state[name] = torch.zeros_like(p, dtype=self._state_dtype(p))
                out[k].append(state[name])
        return out

    def _param_state(self, p: torch.Tensor) -> dict:
        """``self.state[p]``, a ``ParamState`` (a plain dict put there by hand is replaced by one
        with its items, so that writes to it are seen: Note: step plans)."""
        state = self.state[p]
        if type(state) is not ParamState:
            state = self.state[p] = ParamState(self._plans().writes, state)
        return state

    def _keeps_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated through an fp32 master (``master_weights``, fp16/bf16)."""
        return self.master_weights and p.dtype in LOW_PRECISION

    def _masters(self, params: list) -> tuple[list, list | None]:
        """(math params, outs): the fp32 master of each param that keeps one (the kernel writes
        the rounded param into its out slot) and the param itself, with no out, for the others;
        a group may mix both (one kernel call per dtype signature, in shardopt.kernels)."""
        if not any(self._keeps_master(p) for p in params):
            return params, None
        masters, outs = [], []
        for p in params:
            if not self._keeps_master(p):
                masters.append(p)
                outs.append(None)
                continue
            state = self._param_state(p)
            if "master_param" not in state:
                state["master_param"] = p.detach().float()  # preserve_format: p's layout
            masters.append(state["master_param"])
            outs.append(p)
        return masters, outs
