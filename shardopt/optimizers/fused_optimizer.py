"""The base of every single-process fused optimizer: validation, step protocol, state dict.

Subclasses implement ``_update_group(group, params, grads)`` with the kernel calls of their update
rule; everything users see in common (argument checks, the deprecated Apex step arguments, closures,
``zero_grad``, GradScaler hand-off, ``add_param_group``, a torch.optim-compatible state dict with
its hooks) lives here once. ``check_hyperparams`` and ``check_torch_flags`` are also the argument
checks of the ZeRO classes (shardopt/zero/optimizers.py).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardopt import _ops
from shardopt.optimizers.dtensor import check_param_types

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


def check_loaded_groups(saved_groups: list[dict], param_groups: list[dict], owner: str) -> None:
    """A loaded state dict must have this optimizer's number of groups and params per group."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"{owner}: the state dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(param_groups)}"
        )
    for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"{owner}: param group {i} of the state dict has {len(sg['params'])} params, "
                f"this optimizer's has {len(g['params'])}"
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


def _load_hyper(current: Any, saved: Any, written: set[int]) -> Any:
    """The value of a loaded hyperparameter: never the saved object itself.

    A 1-element tensor already in the group (a capturable lr, MixedPrecisionLamb's device lr) is
    written in place, so a captured step keeps reading it; anything else is a deep copy, as
    torch.optim does, so the loading optimizer never shares a tensor with the saved one.
    """
    if (
        torch.is_tensor(current)
        and current.numel() == 1
        and id(current) not in written
        and (isinstance(saved, numbers.Real) or (torch.is_tensor(saved) and saved.numel() == 1))
    ):
        written.add(id(current))
        if torch.is_tensor(saved):
            current.copy_(saved.detach().reshape(current.shape))
        else:
            current.fill_(saved)
        return current
    if torch.is_tensor(saved) and torch.is_tensor(current):
        return saved.detach().to(current.device).clone()
    return copy.deepcopy(saved)


def device_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """lr as the kernels' 1-element fp32 ``lr_t`` on ``device``; a tensor lr already there is a
    view, so writing into it (a scheduler, a captured step) changes what the kernels read."""
    lr_t = lr if torch.is_tensor(lr) else torch.tensor(float(lr))
    return lr_t.to(device=device, dtype=torch.float32).reshape(1)


class FusedOptimizer(torch.optim.Optimizer):
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
        self._before_step()
        first = 0
        for group in self.param_groups:
            first, start = first + len(group["params"]), first
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                check_grad(p, type(self).__name__)
            _ops.check_param_devices(group["params"], type(self).__name__, first_index=start)
            self._advance_step(group, params[0].device)
            self._update_group(group, params, [p.grad for p in params])
        return loss

    # -- hooks for subclasses -------------------------------------------------------------------

    def _before_step(self) -> None:
        """Work across all groups before the per-group updates (LAMB's global grad norm)."""

    def _update_group(self, group: dict, params: list, grads: list) -> None:
        raise NotImplementedError

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
        """lr_t/step_t/grad_scale_t/found_inf_t kernel arguments (all None unless capturable)."""
        if not self.capturable:
            return {}
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

    def _unscale_grads_in_place(self, grads: list, scalars: dict) -> None:
        """Capturable AMP: grads are unscaled in place, so the kernel sees a scale of 1."""
        grad_scale_t = scalars.pop("grad_scale_t", None)
        if grad_scale_t is not None:
            flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            _ops.scale(grads, grads, flag, scale_t=grad_scale_t)

    def _lr_scalar(self, group: dict) -> float:
        lr = group["lr"]
        return 0.0 if torch.is_tensor(lr) and self.capturable else float(lr)

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
            state = self.state[p]
            for k, name in enumerate(self.state_names):
                if name not in state:
                    state[name] = torch.zeros_like(p, dtype=self._state_dtype(p))
                out[k].append(state[name])
        return out

    def _keeps_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated through an fp32 master (``master_weights``, fp16/bf16)."""
        return self.master_weights and p.dtype in LOW_PRECISION

    def _masters(self, params: list) -> tuple[list, list | None]:
        """(math params, outs): the fp32 master of each param that keeps one (the kernel writes
        the rounded param into its out slot) and the param itself, with no out, for the others;
        a group may mix both (one kernel call per dtype signature, in shardopt._ops)."""
        if not any(self._keeps_master(p) for p in params):
            return params, None
        masters, outs = [], []
        for p in params:
            if not self._keeps_master(p):
                masters.append(p)
                outs.append(None)
                continue
            state = self.state[p]
            if "master_param" not in state:
                state["master_param"] = p.detach().float()  # preserve_format: p's layout
            masters.append(state["master_param"])
            outs.append(p)
        return masters, outs

    # -- state dict (torch.optim format and hooks) ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim format; per-param ``step`` entries are added so torch optimizers load it.

        The ``register_state_dict_pre_hook`` / ``_post_hook`` hooks run as in torch.optim: the
        post-hooks see (and may replace) the finished state dict.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        ids: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                ids.setdefault(id(p), len(ids))
            packed["params"] = [ids[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {(ids[id(k)] if torch.is_tensor(k) else k): v for k, v in self.state.items()}
        for packed in groups:
            step = packed.get("step", 0)
            step_t = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
            for pid in packed["params"]:
                if pid in state:
                    state[pid] = {**state[pid], "step": step_t.clone()}
        sd: dict[str, Any] = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the matching torch.optim optimizer.

        State tensors keep full precision: state for fp16/bf16 params is restored in fp32.
        Hyperparameters missing from the loaded groups keep this optimizer's values; loaded ones
        are copies (a tensor lr is never shared with the optimizer that saved it). The
        ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks run as in torch.optim.
        """
        state_dict = state_dict.copy()  # shallow, as torch.optim: a pre-hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        check_loaded_groups(saved_groups, self.param_groups, type(self).__name__)
        new_groups, new_state = [], {}
        written: set[int] = set()
        for g, sg in zip(self.param_groups, saved_groups):
            group = dict(g)
            for k, v in sg.items():
                if k == "step":  # made this optimizer's own below
                    group[k] = v
                elif k != "params":
                    group[k] = _load_hyper(g.get(k), v, written)
            steps = []
            for p, pid in zip(g["params"], sg["params"]):
                if pid not in state_dict["state"]:
                    continue
                entry = {}
                for key, value in state_dict["state"][pid].items():
                    if key == "step":
                        steps.append(float(value))
                    elif torch.is_tensor(value):
                        entry[key] = self._restore_state_tensor(key, value, p)
                    else:
                        entry[key] = copy.deepcopy(value)
                new_state[p] = entry
            if "step" not in sg:
                group["step"] = int(max(steps)) if steps else 0
            step = group["step"]
            if self.capturable and not torch.is_tensor(step):
                group["step"] = torch.tensor(float(step), device=g["params"][0].device)
            elif not self.capturable and torch.is_tensor(step):
                group["step"] = int(step.item())
            elif torch.is_tensor(step):
                group["step"] = step.to(g["params"][0].device, torch.float32).clone()
            new_groups.append(group)
        self.param_groups = new_groups
        self.state = defaultdict(dict, new_state)
        self._after_load()

    def _after_load(self) -> None:
        """Subclass fix-ups of loaded groups (device and dtype of per-group tensors)."""

    def _restore_state_tensor(self, key: str, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point():
            return value.to(device=p.device).clone()
        dtype = torch.float32 if key == "master_param" else self._state_dtype(p)
        value = value.to(device=p.device, dtype=dtype)
        if (
            type(value) is torch.Tensor
            and value.shape == p.shape
            and _ops.is_dense(p)
            and not _ops.same_layout(value, p)
        ):  # state saved for another layout of the param: take the param's, as new state does
            return torch.empty_like(p, dtype=dtype).copy_(value)
        return value.clone()
