"""The base of every single-process fused optimizer: validation, step protocol, state dict.

Subclasses implement ``_update_group(group, params, grads)`` with the kernel calls of their update
rule; everything users see in common (argument checks, the deprecated Apex step arguments, closures,
``zero_grad``, GradScaler hand-off, a torch.optim-compatible state dict) lives here once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardopt import _ops

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer state and math use for params of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_param_dtypes(param_groups: list[dict], owner: str) -> None:
    """Raises TypeError naming the first param (global index) of an unsupported dtype."""
    index = 0
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
        super().__init__(params, defaults)
        check_param_dtypes(self.param_groups, type(self).__name__)
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        for group in self.param_groups:
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
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                check_grad(p, type(self).__name__)
            _ops.common_device(params + [p.grad for p in params], "params and grads")
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

    def _state_tensors(self, params: list) -> list[list[torch.Tensor]]:
        """Per-element state of each param (created as zeros on first use), in slot order."""
        out: list[list[torch.Tensor]] = [[] for _ in self.state_names]
        for p in params:
            state = self.state[p]
            for k, name in enumerate(self.state_names):
                if name not in state:
                    state[name] = torch.zeros_like(p, dtype=acc_dtype(p.dtype))
                out[k].append(state[name])
        return out

    def _masters(self, params: list) -> tuple[list, list | None]:
        """(math params, low-precision outs): fp32 masters for fp16/bf16 params when enabled."""
        if not self.master_weights or not any(p.dtype in LOW_PRECISION for p in params):
            return params, None
        if any(p.dtype not in LOW_PRECISION for p in params):
            raise RuntimeError(
                f"{type(self).__name__}(master_weights=True): a param group mixes low-precision "
                "and fp32 params; put them in separate groups"
            )
        masters = []
        for p in params:
            state = self.state[p]
            if "master_param" not in state:
                state["master_param"] = p.detach().float()
            masters.append(state["master_param"])
        return masters, params

    # -- state dict (torch.optim format) ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim format; per-param ``step`` entries are added so torch optimizers load it."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            step = group.get("step", 0)
            step_t = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
            for pid in group["params"]:
                if pid in sd["state"]:
                    sd["state"][pid] = {**sd["state"][pid], "step": step_t.clone()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the matching torch.optim optimizer.

        State tensors keep full precision: state for fp16/bf16 params is restored in fp32.
        Hyperparameters missing from the loaded groups keep this optimizer's values.
        """
        saved_groups = state_dict["param_groups"]
        check_loaded_groups(saved_groups, self.param_groups, type(self).__name__)
        new_groups, new_state = [], {}
        for g, sg in zip(self.param_groups, saved_groups):
            group = {**g, **{k: v for k, v in sg.items() if k != "params"}}
            group["params"] = g["params"]
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
                        entry[key] = value
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

    def _restore_state_tensor(self, key: str, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point():
            return value.to(device=p.device).clone()
        dtype = torch.float32 if key == "master_param" else acc_dtype(p.dtype)
        return value.to(device=p.device, dtype=dtype).clone()
