"""torch.optim's state-dict format and hooks for the single-process optimizers.

``TorchStateDict`` is a base of ``FusedOptimizer`` (shardopt/optimizers/fused_optimizer.py): its
``state_dict()`` is torch.optim's format with a per-param ``step`` added, so it loads into the
matching torch.optim class, and its ``load_state_dict()`` takes those of this class or of
torch.optim's, with the hooks torch.optim runs. Loading replaces the state and drops the step
plans (Note: step plans, shardopt/optimizers/step_plan.py).
"""

from __future__ import annotations

import copy
import numbers
from collections import defaultdict
from typing import Any

import torch

from shardopt import kernels as _ops
from shardopt.optimizers.step_plan import ParamState


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


#: per-param state keys every optimizer accepts besides its own state names
COMMON_STATE_KEYS = ("step", "master_param")


def check_state_keys(
    saved_state: dict[Any, dict[str, Any]], state_names: tuple[str, ...], owner: str
) -> None:
    """Refuses another algorithm's state dict (a torch.optim.SGD's into an Adam).

    Every per-param entry may hold only ``state_names`` plus ``step`` and ``master_param``, and
    an entry holding any of ``state_names`` must hold all of them (one missing would silently
    start from zeros). Raises ValueError naming the param and both sets of keys.
    """
    mine = set(state_names)
    for pid, entry in saved_state.items():
        keys = set(entry)
        unknown = keys - mine - set(COMMON_STATE_KEYS)
        missing = mine - keys if keys & mine else set()
        if unknown or missing:
            why = [f"{sorted(unknown)} unknown to {owner}"] if unknown else []
            why += [f"{sorted(missing)} missing"] if missing else []
            raise ValueError(
                f"{owner}: the state dict is not this optimizer's: the state of param {pid} has "
                f"keys {sorted(keys)} ({', '.join(why)}); {owner} keeps {list(state_names)} per "
                f"param (plus {list(COMMON_STATE_KEYS)}). Load a state dict of the same algorithm"
            )


class TorchStateDict:
    """``state_dict``/``load_state_dict`` of a ``FusedOptimizer`` (not used on its own)."""

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
        state = {(ids[id(k)] if torch.is_tensor(k) else k): dict(v) for k, v in self.state.items()}
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
        self._check_state_keys(state_dict["state"], saved_groups)
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
                new_state[p] = ParamState(self._plans().writes, entry)
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
        self._plans().clear()
        self._after_load()

    def _check_state_keys(self, saved_state: dict, saved_groups: list[dict]) -> None:
        """Refuses another algorithm's state (``check_state_keys``); a class whose groups keep
        different state (FusedMuon's AdamW groups) checks each group's params on its own."""
        check_state_keys(saved_state, self.state_names, type(self).__name__)

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
