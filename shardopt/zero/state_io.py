"""The state-I/O interface of the distributed optimizers, and their torch.optim state dicts.

One interface serves ``state_dict()``/``load_state_dict()``, the sharded checkpoint
(``shardopt.checkpoint``) and DCP alike:

- ``shard_fragments()``: this rank's fragments, each a (param, element range) with views of the
  master and state shards over it; writing into the views changes the optimizer's state;
- ``export_param_groups()`` / ``import_param_groups()``: every param group key (hyperparameters,
  ``initial_lr`` and other keys schedulers add, the step, algorithm extras), with params as
  indices into ``all_params``; the one way a group is serialised;
- ``saved_names(param)``: the values a saver holds for a param (state names, and the master
  unless the param is an fp32 param that is its own master);
- ``publish_masters()``: writes the masters into the params after state was written
  (``restore_weights=True``: a checkpoint's masters become the params in every storage format).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.optimizers.state_dict import check_loaded_groups, check_state_keys
from shardopt.zero import comm, state_storage
from shardopt.zero.layout import Range
from shardopt.zero.settings import describe_hyperparams, raise_if_hyperparams_differ
from shardopt.zero.state_storage import MASTER

PARAM_STEPS = "param_steps"  # own step of each param of a group, when some were skipped


@dataclass
class ShardFragment:
    """One fragment this rank owns: elements ``param_range`` of flattened param ``param``."""

    param: int  # index into ``all_params`` (torch.optim state-dict id)
    param_range: Range
    tensors: dict[str, torch.Tensor]  # state name (and ``master_param``) -> writable view


def set_group_value(group: dict, name: str, value: Any) -> None:
    """Sets a loaded group value; a tensor one (lr of a captured step) is updated in place, so
    what the kernels read stays bound."""
    current = group.get(name)
    if torch.is_tensor(current) and not torch.is_tensor(value):
        current.fill_(float(value))
    elif torch.is_tensor(current):
        current.copy_(value)
    elif isinstance(current, tuple) and isinstance(value, list):
        group[name] = tuple(value)
    else:
        group[name] = value


class StateIO:
    """Mixin of ``DistributedOptimizer``: the interface above plus the torch.optim state dict."""

    #: (the groups' steps, the state dict) kept by ``consolidate_state_dict`` on its rank ``to``
    _consolidated: tuple[tuple[float, ...], dict[str, Any]] | None = None

    # -- the interface ---------------------------------------------------------------------------

    def shard_fragments(self, writable: bool = False) -> Iterator[ShardFragment]:
        """This rank's fragments in shard order, with the fp32 values of their master and state.

        Plain fp32 storage hands out views: writing into them changes the optimizer's state.
        Compact storage (see Note: compact storage in state_storage.py) hands out decoded
        copies; with ``writable=True`` they are kept (the same copies on every call) and
        ``publish_masters()`` encodes what was written into them. Every writer ends with
        ``publish_masters()``.
        """
        self.wait_param_sync()  # the last step's update and all-gathers (CPU offload: its worker)
        sharded = self.sharded
        sharded.pull_written_params()  # CPU offload: host copies of the params follow them
        staged = getattr(self, "_staged", None)
        if writable and staged is None:
            staged = self._staged = {}
        for key in sharded.keys:
            buf = key.buffers
            names = list(buf.state) + [MASTER]
            coded = state_storage.needs_codec(buf)
            for position, f in enumerate(buf.fragments):
                if not coded:
                    tensors = {n: buf.fragment(self._shard(buf, n), f) for n in names}
                elif writable:
                    tensors = staged.get((key.index, position))
                    if tensors is None:
                        tensors = {n: state_storage.read(buf, n, f.shard_range) for n in names}
                        staged[(key.index, position)] = tensors
                else:
                    tensors = {n: state_storage.read(buf, n, f.shard_range) for n in names}
                yield ShardFragment(sharded.all_index[f.param], f.param_range, tensors)

    def saved_names(self, param: int) -> list[str]:
        """The fp32 values state I/O holds for ``all_params[param]`` beyond the param itself:
        its state names, and ``master_param`` unless it is an fp32 param that is its own master
        (see Note: compact storage in state_storage.py). Empty for a frozen param."""
        i = self.sharded.param_index.get(id(self.all_params[param]))
        if i is None:
            return []
        buf = self.sharded.param_key[i].buffers
        own = buf.master_kind == "param" and self.all_params[param].dtype == torch.float32
        return list(buf.state) + ([] if own else [MASTER])

    @staticmethod
    def _shard(buf, name: str):
        return buf.master if name == MASTER else buf.state[name]

    def _commit_staged(self, restore_weights: bool = False) -> None:
        """Encodes the values written into ``shard_fragments(writable=True)``'s copies."""
        staged = getattr(self, "_staged", None)
        self._staged = None
        if not staged:
            return
        with torch.no_grad():
            for (key_index, position), tensors in staged.items():
                buf = self.sharded.keys[key_index].buffers
                f = buf.fragments[position]
                for n, values in tensors.items():
                    state_storage.write(
                        buf, n, f.shard_range, values, restore_weights=restore_weights
                    )

    def drop_staged(self) -> None:
        """Forgets uncommitted writable copies (the step changes the state under them)."""
        self._staged = None

    def export_param_groups(self) -> list[dict[str, Any]]:
        """Every group's keys (params as ``all_params`` indices, step as an int, algorithm extras
        such as NovoGrad's per-param second moment)."""
        ids = {id(p): i for i, p in enumerate(self.all_params)}
        groups = []
        for gi, group in enumerate(self.param_groups):
            saved = {k: v for k, v in group.items() if k not in ("params", "step")}
            saved["step"] = int(group["step"].item())
            saved["params"] = [ids[id(p)] for p in group["params"]]
            saved.update(self._extra_group_state(gi))
            offsets = [self._offset(p) for p in group["params"]]
            if any(offsets):  # see Note: skipped params in update_calls.py
                saved[PARAM_STEPS] = [saved["step"] - o for o in offsets]
            groups.append(saved)
        return groups

    def _offset(self, p: torch.Tensor) -> int:
        i = self.sharded.param_index.get(id(p))
        return 0 if i is None else self.update_calls.offsets[i]

    def _set_own_step(self, p: torch.Tensor, group_step: float, own_step: float) -> None:
        i = self.sharded.param_index.get(id(p))
        if i is not None:
            self.update_calls.offsets[i] = max(0, int(group_step - own_step))

    @torch.no_grad()
    def import_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Restores every key of ``export_param_groups()`` (or of a torch.optim state dict's
        groups: a missing step is taken from the per-param state)."""
        check_loaded_groups(groups, self.param_groups, type(self).__name__)
        extras = set(self._extra_group_state(0)) if self.param_groups else set()
        for gi, (group, saved) in enumerate(zip(self.param_groups, groups)):
            for k, v in saved.items():
                if k not in ("params", "step", PARAM_STEPS) and k not in extras:
                    set_group_value(group, k, v)
            step = float(saved.get("step", 0))
            group["step"].fill_(step)  # in place: keeps a captured binding
            own = saved.get(PARAM_STEPS, [step] * len(group["params"]))
            for p, own_step in zip(group["params"], own):
                self._set_own_step(p, step, float(own_step))
            self._load_extra_group_state(gi, saved)

    def publish_masters(self, restore_weights: bool = False) -> None:
        """Stores what was written into writable fragments, writes the master shards into the
        params and all-gathers them (collective).

        Args:
            restore_weights: the masters written are the weights to restore (a checkpoint's):
                every storage format takes them as written, so the params become them. Without
                it, a master kept in the params' own bits (``remainder`` keys, 16-bit params
                that are their own masters) is kept only where it rounds to the param (see
                Note: the params are the truth in engine.py).
        """
        self._commit_staged(restore_weights)
        self.param_sync.publish_masters()

    # -- algorithm hooks -------------------------------------------------------------------------

    def _extra_group_state(self, group_index: int) -> dict[str, Any]:
        """Algorithm-specific per-group entries (NovoGrad's norms); the same keys for every
        group."""
        return {}

    def _load_extra_group_state(self, group_index: int, saved_group: dict) -> None:
        """Restores what ``_extra_group_state`` saved."""

    # -- torch.optim state dict ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full, world-size independent state in torch.optim's format (same on every rank).

        Built bucket by bucket: each state shard is all-gathered one bucket at a time and copied
        out into per-param CPU tensors, so the device never holds more than one bucket extra.
        Params that are their own masters (fp32 gathered in fp32) save no ``master_param``.
        The ``register_state_dict_pre_hook`` / ``_post_hook`` hooks run as in torch.optim: a
        pre-hook gets the optimizer, a post-hook the optimizer and the finished dict, and what a
        post-hook returns (not None) replaces the dict. Collective.
        """
        kept, self._consolidated = self._consolidated, None
        if kept is not None and kept[0] == self._steps_taken():
            return kept[1]  # consolidate_state_dict() made it on every rank, no step since
        self.enter_collective("state_dict()")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self._gather_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's ``ZeroRedundancyOptimizer`` call, for scripts ported from it: collective;
        afterwards ``state_dict()`` on the rank ``to`` (a global rank) alone returns the whole
        state without a collective, until the next step. shardopt's ``state_dict()`` is itself
        the collective that returns the whole state on every rank: new code calls it on every
        rank instead (docs/migration.md, "From ZeroRedundancyOptimizer").
        """
        sd = self.state_dict()
        mine = comm.global_rank(self.process_group, self.rank) == to
        self._consolidated = (self._steps_taken(), sd) if mine else None

    def _steps_taken(self) -> tuple[float, ...]:
        return tuple(float(g["step"]) for g in self.param_groups)

    @torch.no_grad()
    def _gather_state_dict(self) -> dict[str, Any]:
        self.wait_param_sync()
        sharded = self.sharded
        state: dict[int, dict[str, Any]] = {}
        for key in sharded.keys:
            buf = key.buffers
            names = list(buf.state) + ([] if buf.master_is_param else [MASTER])
            for bucket in key.layout.buckets:
                gathered = {}
                chunk = Range(bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel)
                for name in names:
                    mine = state_storage.read(buf, name, chunk).to(sharded.device)  # offload
                    out = torch.empty(bucket.numel, dtype=mine.dtype, device=sharded.device)
                    comm.all_gather(out, mine, self.process_group, async_op=False).wait()
                    gathered[name] = out.cpu()
                for i in bucket.params:
                    p = sharded.params[i]
                    space = key.layout.space_ranges[i]
                    piece = space.intersect(bucket.space_range)
                    entry = state.setdefault(sharded.all_index[i], {})
                    for name, full_bucket in gathered.items():
                        full = entry.setdefault(
                            name, torch.zeros(p.numel(), dtype=full_bucket.dtype)
                        )
                        src = piece.shift(-bucket.space_range.start)
                        full[piece.start - space.start : piece.end - space.start].copy_(
                            full_bucket[src.start : src.end]
                        )
        groups = self.export_param_groups()
        for saved in groups:
            own = saved.pop(PARAM_STEPS, [saved["step"]] * len(saved["params"]))
            for pid, own_step in zip(saved["params"], own):
                entry = state.get(pid)
                if entry is None:
                    continue
                shape = self.all_params[pid].shape
                for name in list(entry):
                    entry[name] = entry[name].view(shape)
                entry["step"] = torch.tensor(float(own_step))
        return {"state": state, "param_groups": groups}

    def _check_loaded(self, state_dict: dict[str, Any]) -> tuple[list[dict], dict[int, Any]]:
        """The checks of ``load_state_dict`` (this rank's); the groups to import (with the step
        and each param's own step) and each param's id in the state dict."""
        name = type(self).__name__
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        check_loaded_groups(saved_groups, self.param_groups, name)
        saved_state = state_dict["state"]
        check_state_keys(saved_state, self.state_names, name)
        saved_id: dict[int, Any] = {}
        for group, sg in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], sg["params"]):
                saved_id[id(p)] = pid
                for key_name, value in saved_state.get(pid, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() != p.numel():
                        raise ValueError(
                            f"{name}: state '{key_name}' of param {pid} has {value.numel()} "
                            f"elements, the param has {p.numel()}"
                        )
            # torch.optim keeps the step per param (none: never updated): the group's is the
            # largest, a param's own step below it counts the steps it was skipped
            steps = [
                float(saved_state[pid].get("step", -1)) if pid in saved_state else 0.0
                for pid in sg["params"]
            ]
            if "step" not in sg or max(steps + [0.0]) > float(sg["step"]):
                # (a torch.optim optimizer that loaded ours keeps our group "step" unchanged
                # while it counts the per-param steps on)
                sg["step"] = max(steps + [0.0])
            if PARAM_STEPS not in sg:
                sg[PARAM_STEPS] = [s if s >= 0 else sg["step"] for s in steps]
        return saved_groups, saved_id

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict from ``state_dict()`` at any world size or bucket size, or one of
        the matching single-process optimizer (FusedAdam, torch.optim.AdamW, ...).

        Each rank copies only the fragments it owns; every group key is restored. A saved
        ``master_param`` is kept only where it rounds to the param's current value (the params
        are the truth: a model loaded or trained elsewhere since is not undone). The
        ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks run as in torch.optim: a
        pre-hook gets the optimizer and a shallow copy of ``state_dict`` and may return a dict
        to load instead; a post-hook gets the optimizer after loading. Collective.
        """
        self.enter_collective("load_state_dict()")
        state_dict = state_dict.copy()  # shallow, as torch.optim: a pre-hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._scatter_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @torch.no_grad()
    def _scatter_state_dict(self, state_dict: dict[str, Any]) -> None:
        name = type(self).__name__
        self.wait_param_sync()  # nothing of the last step may write the state after this
        error = None
        try:  # a state dict refused on one rank must be refused on every rank, not hang them
            saved_groups, saved_id = self._check_loaded(state_dict)
        except (ValueError, TypeError, KeyError) as e:
            error = e
        extras = set(self._extra_group_state(0)) if self.param_groups else set()
        skip = frozenset({PARAM_STEPS, *extras})
        mine = describe_hyperparams(saved_groups, skip) if error is None else None
        everyone = comm.gather_checked(error, mine, self.process_group)
        raise_if_hyperparams_differ(name, "the loaded group hyperparameters and steps", mine,
                                    everyone, self.sharded.rank)  # fmt: skip
        saved_state = state_dict["state"]
        for frag in self.shard_fragments(writable=True):
            p = self.all_params[frag.param]
            entry = saved_state.get(saved_id[id(p)], {})
            r = frag.param_range
            for sname, view in frag.tensors.items():
                if sname == MASTER:
                    continue
                if sname in entry:
                    view.copy_(entry[sname].detach().reshape(-1)[r.start : r.end])
                else:
                    view.zero_()
            source = entry[MASTER] if MASTER in entry else p.detach()
            frag.tensors[MASTER].copy_(source.detach().reshape(-1)[r.start : r.end])
        self.sharded.refresh_masters(force=True)
        self.import_param_groups(saved_groups)
        self.publish_masters()

    # -- torch.distributed.checkpoint --------------------------------------------------------------

    def sharded_state_dict(self, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """The state as DTensors for ``torch.distributed.checkpoint``, keyed by ``model``'s FQNs
        when given (collective); see ``shardopt.zero.dcp_state``. Load with ``dcp.load`` then
        ``load_sharded_state_dict``."""
        from shardopt.zero.dcp_state import sharded_state_dict

        self.enter_collective("sharded_state_dict()")
        return sharded_state_dict(self, model)

    def load_sharded_state_dict(
        self, state_dict: dict[str, Any], model: torch.nn.Module | None = None
    ) -> None:
        """Finishes a ``torch.distributed.checkpoint.load`` into ``sharded_state_dict()``."""
        from shardopt.zero.dcp_state import load_sharded_state_dict

        self.enter_collective("load_sharded_state_dict()")
        load_sharded_state_dict(self, state_dict, model)
