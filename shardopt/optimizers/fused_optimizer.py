"""The base of every single-process fused optimizer: validation, step protocol, state dict.

Subclasses implement ``_group_tensors(group, params)`` (the tensors their kernels take besides the
grads: state, masters, outs; created on first use) and ``_apply(group, grads, tensors, as_is)``
(the kernel calls of their update rule); the step keeps the first per group in a plan (see Note:
step plans in step_plan.py). Everything users see in common (argument checks, the deprecated Apex
step arguments, closures, ``zero_grad``, GradScaler hand-off, ``add_param_group``) lives here
once, and the torch.optim-compatible state dict with its hooks in ``TorchStateDict``
(state_dict.py). ``check_hyperparams`` and ``check_torch_flags`` are also the argument checks of
the ZeRO classes (shardopt/zero/optimizers.py).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardopt import kernels as _ops
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


def reject_amsgrad(amsgrad: bool, owner: str) -> None:
    if amsgrad:
        raise RuntimeError(f"{owner} does not support the AMSGrad variant.")


# Apex's positional order puts bias_correction where torch.optim.Adam has betas.
_APEX_ORDER = (
    "{owner}: {arg} got {value!r}, which looks like betas. Apex's positional order is "
    "{owner}(params, lr, {order}betas, eps, ...), unlike torch.optim.Adam(params, lr, betas, eps, "
    "...); pass betas=... (and the other hyperparameters) by keyword"
)


def _value(x: Any) -> Any:
    """A 1-element tensor hyperparameter as a Python number (read once, at construction)."""
    if torch.is_tensor(x) and x.numel() == 1 and x.device.type != "meta":
        return x.item()
    return x


def check_hyperparams(defaults: dict[str, Any], owner: str) -> None:
    """torch.optim's constructor checks, with its messages, for the hyperparameters in ``defaults``.

    ValueError for lr < 0, eps < 0, a beta outside [0, 1), weight_decay < 0, momentum < 0,
    max_grad_norm < 0 and any NaN (the comparisons are written so that NaN fails them); TypeError
    for betas that are not a pair, a tensor lr of more than one element, and a tuple passed
    positionally into ``bias_correction`` (Apex's argument order differs from torch's). Shared by
    every single-process and ZeRO class.
    """
    bias_correction = defaults.get("bias_correction", True)
    if isinstance(bias_correction, (tuple, list)) or torch.is_tensor(bias_correction):
        order = "bias_correction, "
        raise TypeError(
            _APEX_ORDER.format(
                owner=owner, arg="bias_correction", value=bias_correction, order=order
            )
        )
    if "lr" in defaults:
        lr = defaults["lr"]
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        value = _value(lr)
        if not isinstance(value, numbers.Real) and not torch.is_tensor(value):
            raise TypeError(f"{owner}: lr must be a number or a 1-element tensor, got {lr!r}")
        if isinstance(value, numbers.Real) and not 0.0 <= value:
            raise ValueError(f"Invalid learning rate: {value}")
    if "eps" in defaults and not 0.0 <= _value(defaults["eps"]):
        raise ValueError(f"Invalid epsilon value: {defaults['eps']}")
    if "betas" in defaults:
        betas = defaults["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            if not 0.0 <= _value(beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {_value(beta)}")
    for name in ("weight_decay", "momentum", "max_grad_norm"):
        if name in defaults and not 0.0 <= _value(defaults[name]):
            raise ValueError(f"Invalid {name} value: {defaults[name]}")
    for name, value in defaults.items():  # e.g. dampening: torch does not check it, NaN is no value
        value = _value(value)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"Invalid {name} value: {value}")
    if defaults.get("nesterov") and (
        defaults.get("momentum", 0) <= 0 or defaults.get("dampening", 0) != 0
    ):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def check_torch_flags(
    owner: str,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
    maximize_supported: bool = True,
) -> None:
    """torch.optim's common keyword arguments.

    ``foreach`` and ``fused`` are accepted and ignored (the kernels are always fused multi-tensor
    kernels); ``differentiable=True`` is rejected (the kernels update in place, outside autograd);
    ``maximize=True`` is rejected where the class does not implement it.
    """
    del foreach, fused  # no-ops: there is only the fused path
    if differentiable:
        raise NotImplementedError(
            f"{owner} does not support differentiable=True: its fused kernels update the params "
            "in place outside autograd; use a torch.optim optimizer with differentiable=True to "
            "differentiate through the step"
        )
    if maximize and not maximize_supported:
        raise NotImplementedError(
            f"{owner} does not support maximize=True (neither does Apex's); minimize the negated "
            "objective instead"
        )


def maximize_scale(group: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """``grad_scale_t=-1`` for a ``maximize`` group (the kernels multiply every grad element by
    it, so the update ascends), else nothing. Made on the device: no host-to-device copy."""
    if not group.get("maximize", False):
        return {}
    return {"grad_scale_t": torch.full((1,), -1.0, dtype=torch.float32, device=device)}


def device_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """lr as the kernels' 1-element fp32 ``lr_t`` on ``device``; a tensor lr already there is a
    view, so writing into it (a scheduler, a captured step) changes what the kernels read."""
    lr_t = lr if torch.is_tensor(lr) else torch.tensor(float(lr))
    return lr_t.to(device=device, dtype=torch.float32).reshape(1)


class FusedOptimizer(TorchStateDict, torch.optim.Optimizer):
    """Common machinery of the fused single-process optimizers (not used directly)."""

    #: per-element state tensors of the update rule, in kernel slot order
    state_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        set_grad_none: bool,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        check_hyperparams(defaults, type(self).__name__)
        super().__init__(params, defaults)
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

    def _device_scalars(self, group: dict, device: torch.device) -> dict[str, torch.Tensor | None]:
        """lr_t/step_t/grad_scale_t/found_inf_t kernel arguments: all of them when capturable,
        else only ``lr_t`` for a tensor lr (see ``_lr_args``)."""
        if not self.capturable:
            lr = group["lr"]
            return {"lr_t": device_lr(lr, device)} if torch.is_tensor(lr) else {}
        scalars = {
            "lr_t": device_lr(group["lr"], device),
            "step_t": group["step"].to(device=device, dtype=torch.float32).reshape(1),
        }
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

    def _lr_scalar(self, group: dict) -> float:
        """The host lr: 0 for a tensor lr, which the kernels read on the device (``lr_t``)."""
        lr = group["lr"]
        return 0.0 if torch.is_tensor(lr) else float(lr)

    def _lr_args(self, group: dict, device: torch.device) -> dict[str, Any]:
        """lr keyword arguments of a kernel call: a tensor lr is read on the device (no host
        sync; under torch.compile a scheduler's new value needs no recompile), a float as is."""
        lr = group["lr"]
        if torch.is_tensor(lr):
            return {"lr": 0.0, "lr_t": device_lr(lr, device)}
        return {"lr": float(lr)}

    def _step_scalar(self, group: dict) -> int:
        return 0 if torch.is_tensor(group["step"]) else int(group["step"])

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
