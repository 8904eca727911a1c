"""The params of a distributed optimizer: checked across ranks, planned into keys, bound to flat
buffers (see Note: buckets and shards in docs/design.md).

A key is one (param group, param dtype) set of trainable params with its plan (``KeyLayout``, by
its group's ``ShardLayout``) and its buffers (``KeyBuffers``). Params become views of their key's
param buffer, so an all-gather writes straight into them; frozen params get no buckets and no
state.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import kernels as _ops
from shardopt.optimizers.fused_optimizer import LOW_PRECISION
from shardopt.zero import comm
from shardopt.zero.flat_buffer import KeyBuffers
from shardopt.zero.layout import ElementLayout, KeyLayout, Range, ShardLayout
from shardopt.zero.offload import host_state
from shardopt.zero.offload.plan import split_params
from shardopt.zero.settings import describe_hyperparams, raise_if_hyperparams_differ
from shardopt.zero.state_storage import Storage
from shardopt.zero.sync_bits import sync_to_params, write_sync

ALIGN_BYTES = 128

# param id -> the distributed optimizer that shards it (a param is a view of one optimizer's
# buffer; a second optimizer would silently break the first). Keyed by id, not stored on the
# param, so copies of a model (copy.deepcopy) do not inherit it.
_OWNERS: dict[int, weakref.ref] = {}


def owner_of(p: torch.Tensor):
    """The live distributed optimizer sharding ``p``, or None."""
    ref = _OWNERS.get(id(p))
    owner = ref() if ref is not None else None
    if owner is None or not any(q is p for q in owner.all_params):
        return None
    return owner


def claim(params: list[torch.Tensor], owner) -> None:
    ref = weakref.ref(owner)
    for p in params:
        _OWNERS[id(p)] = ref


def release(params: list[torch.Tensor], owner) -> None:
    for p in params:
        ref = _OWNERS.get(id(p))
        if ref is not None and ref() in (owner, None):
            del _OWNERS[id(p)]


class ParamReboundError(RuntimeError):
    """A param was replaced by a tensor that cannot be a view of its buffer."""

    def __init__(self, param: int, message: str) -> None:
        super().__init__(message)
        self.param = param  # index among all params


@dataclass
class Key:
    """One (param group, param dtype) set of params, its plan and its buffers."""

    index: int
    group_index: int
    param_dtype: torch.dtype
    layout: KeyLayout
    buffers: KeyBuffers


@dataclass(frozen=True)
class ShardingConfig:
    """The sharding settings every rank must agree on (checked at construction)."""

    bucket_cap_mb: float
    state_dtype: torch.dtype
    grad_sync_dtype: torch.dtype | None
    param_sync_dtype: torch.dtype | None
    average_grad_sync: bool
    overlap_grad_sync: bool
    overlap_param_sync: bool
    capturable: bool
    skip_unused_params: bool
    storage: Storage = Storage()
    #: NCCL user-buffer registration (shardopt/zero/apex/user_buffers.py): persistent grad buffers
    nccl_ub: bool = False
    #: (engine param index, grad-sync dtype, param-sync dtype) of params given other dtypes by
    #: Apex's ``init_params(params, grad_sync_dtype=..., param_sync_dtype=...)``, by index
    per_param: tuple[tuple[int, torch.dtype, torch.dtype], ...] = ()
    #: CPU offload: the share of each key's elements whose state lives on the host (None: no
    #: offload; see Note: which params stay on the GPU in offload_plan.py)
    offload_fraction: float | None = None
    #: CPU offload: host state on transparent huge pages (``CPUOffload.huge_pages``)
    offload_huge_pages: bool = False

    def describe(self) -> tuple:
        return tuple(str(v) for v in self.__dict__.values())

    def grad_sync_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """Low-precision and fp64 params accumulate and sync grads in fp32 (the math's dtype)
        unless told otherwise."""
        if self.grad_sync_dtype is not None:
            return self.grad_sync_dtype
        return torch.float32 if param_dtype in LOW_PRECISION + (torch.float64,) else param_dtype

    def sync_dtypes(self) -> Callable[[int, torch.dtype], tuple[torch.dtype, torch.dtype]]:
        """(grad-sync dtype, param-sync dtype) of engine param ``i`` of dtype ``param_dtype``: the
        optimizer's, or the ones ``init_params`` gave it. An integer param-sync dtype as wide as
        the param is the param dtype (the same bits)."""
        chosen = {i: (g, s) for i, g, s in self.per_param}

        def of(i: int, param_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
            grad, sync = chosen.get(
                i, (self.grad_sync_dtype_for(param_dtype), self.param_sync_dtype or param_dtype)
            )
            if not sync.is_floating_point and sync.itemsize == param_dtype.itemsize:
                sync = param_dtype
            return grad, sync

        return of


class ShardedParams:
    """The optimizer's params, their keys and the index maps between them.

    Index spaces: *all* params (param-group order, frozen included: torch.optim state-dict ids)
    and *engine* params (trainable only: ``params[i]``); ``all_index[i]`` maps the second to the
    first.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        config: ShardingConfig,
        state_names: tuple[str, ...],
        *,
        state_signed: dict[str, bool] | None = None,
        process_group: comm.ProcessGroup | None,
        redundant_process_group: comm.ProcessGroup | None,
        owner: str,
        layouts: list[ShardLayout] | None = None,
        allocating: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.owner = owner
        #: the context the collectives' buffers are allocated in (an NCCL-registered pool with
        #: ``nccl_ub``; optimizer state stays outside it)
        self.allocating = allocating
        self.config = config
        self.process_group = process_group
        self.rank = comm.rank(process_group)
        self.world_size = comm.world_size(process_group)
        self.all_params: list[torch.Tensor] = [p for g in param_groups for p in g["params"]]
        seen: dict[int, int] = {}
        for i, p in enumerate(self.all_params):
            if id(p) in seen:
                raise ValueError(
                    f"{owner}: param {i} is the same tensor as param {seen[id(p)]}; pass each "
                    "param once (tied params are one param)"
                )
            seen[id(p)] = i
            other = owner_of(p)
            if other is not None:
                raise ValueError(
                    f"{owner}: param {i} {tuple(p.shape)} already belongs to another distributed "
                    f"optimizer ({type(other).__name__}); a param can be sharded by one optimizer "
                    "only (close() the other one first)"
                )
        self.params: list[torch.Tensor] = [p for p in self.all_params if p.requires_grad]
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        position = {id(p): i for i, p in enumerate(self.all_params)}
        #: engine param index -> index among all params (torch.optim state-dict ids)
        self.all_index = [position[id(p)] for p in self.params]
        self.device = _ops.common_device(self.all_params, "params")
        #: each param group's layout (``DistributedOptimizer.shard_layout``)
        self.layouts = layouts or [ElementLayout()] * len(param_groups)
        try:  # a layout failing on one rank must fail on every rank, not hang the others
            plans, failed = self._plan_keys(param_groups), None
        except (TypeError, ValueError) as e:
            plans, failed = [], e
        self._check_same_everywhere(param_groups, plans, failed)
        self._broadcast(redundant_process_group)
        self.keys: list[Key] = self._build_keys(plans, state_names, state_signed)
        self.param_key: dict[int, Key] = {i: key for key in self.keys for i in key.layout.params}
        #: param -> (bucket index, bucket_range, param_range) of each bucket it has elements in
        self.pieces: dict[int, list[tuple[int, Range, Range]]] = {
            i: key.layout.param_pieces(i) for key in self.keys for i in key.layout.params
        }
        self.param_buckets: dict[int, list[int]] = {
            i: [b for b, _, _ in pieces] for i, pieces in self.pieces.items()
        }
        self._bind()
        # Built once so the step does no host-to-device copies (LAMB's and NovoGrad's per-param
        # reductions index with them).
        self.fragment_indices = [
            torch.tensor(
                [f.param for f in k.buffers.fragments], dtype=torch.long, device=self.device
            )
            for k in self.keys
        ]
        self.member_indices = [
            torch.tensor(list(k.layout.params), dtype=torch.long, device=self.device)
            for k in self.keys
        ]

    def _check_same_everywhere(
        self, param_groups: list[dict[str, Any]], plans: list, failed: Exception | None = None
    ) -> None:
        """Every rank must register the same params (order, shape, dtype, requires_grad) in the
        same groups, with the same sharding settings and planned layouts; else every rank raises
        here, not at the first collective."""
        desc = [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in self.all_params]
        groups = [len(g["params"]) for g in param_groups]
        hyper = describe_hyperparams(param_groups)
        planned = [(part[0], self.layouts[part[0]].name, part[-1].digest()) for part in plans]
        mine = (desc, groups, self.config.describe(), hyper, planned, repr(failed))
        everyone = comm.all_gather_object(mine, self.process_group)
        if failed is not None:
            raise failed
        bad = next((r for r, e in enumerate(everyone) if e[5] != "None"), None)
        if bad is not None:
            raise ValueError(f"{self.owner}: planning the shard layout failed on rank {bad}: "
                             f"{everyone[bad][5]}")  # fmt: skip
        for r, (other, other_groups, other_config, _, other_planned, _) in enumerate(everyone):
            diffs = [
                f"param {i}: rank {self.rank} has {a}, rank {r} has {b}"
                for i, (a, b) in enumerate(zip(desc, other))
                if a != b
            ]
            if len(desc) != len(other):
                diffs.insert(
                    0, f"rank {self.rank} has {len(desc)} params, rank {r} has {len(other)}"
                )
            if groups != other_groups:
                diffs.append(
                    f"params per group: rank {self.rank} has {groups}, rank {r} has {other_groups}"
                )
            if diffs:
                raise RuntimeError(
                    f"{self.owner}: params differ between ranks (same model, same order and "
                    "groups required on every rank): " + "; ".join(diffs[:5])
                )
            if other_config != self.config.describe():
                names = list(self.config.__dict__)
                settings = [
                    f"{n}: rank {self.rank} has {a}, rank {r} has {b}"
                    for n, a, b in zip(names, self.config.describe(), other_config)
                    if a != b
                ]
                raise ValueError(
                    f"{self.owner}: sharding settings differ between ranks (they must be equal on "
                    "every rank): " + "; ".join(settings)
                )
            if other_planned != planned:
                gi, name, _ = next(a for a, b in zip(planned, other_planned) if a != b)
                raise ValueError(
                    f"{self.owner}: the shard layouts of group {gi} ({name}) differ between ranks "
                    f"{self.rank} and {r}: shard_layout(group) must give the same layout on every "
                    "rank (a cost the same function of the shape everywhere)"
                )
        raise_if_hyperparams_differ(
            self.owner, "group hyperparameters", hyper, [e[3] for e in everyone], self.rank
        )

    def _broadcast(self, redundant_process_group: comm.ProcessGroup | None) -> None:
        """Every rank starts from rank 0's params, as DDP does."""
        with torch.no_grad():
            data = [p.data for p in self.all_params]
            comm.broadcast(data, 0, self.process_group)
            if redundant_process_group is not None:
                comm.broadcast(data, 0, redundant_process_group)

    def _plan_keys(self, param_groups: list[dict[str, Any]]) -> list[tuple]:
        """(group, param dtype, grad-sync dtype, param-sync dtype, offloaded, layout) of every
        key, each planned by its group's layout (pure data: no buffer yet)."""
        dtypes_of = self.config.sync_dtypes()
        # one key per (group, param dtype, grad-sync dtype, param-sync dtype)
        by_key: dict[tuple[int, torch.dtype, torch.dtype, torch.dtype], list[int]] = {}
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    i = self.param_index[id(p)]
                    by_key.setdefault((gi, p.dtype, *dtypes_of(i, p.dtype)), []).append(i)
        config = self.config
        parts = []
        for (gi, dtype, grad_dtype, sync_dtype), indices in by_key.items():
            if config.offload_fraction is None:
                parts.append((gi, dtype, grad_dtype, sync_dtype, indices, False))
                continue
            kept = split_params([self.params[i].numel() for i in indices], config.offload_fraction)
            if kept < len(indices):  # the host part first: its grads arrive first
                parts.append((gi, dtype, grad_dtype, sync_dtype, indices[kept:], True))
            if kept > 0:
                parts.append((gi, dtype, grad_dtype, sync_dtype, indices[:kept], False))
        plans = []
        for gi, dtype, grad_dtype, sync_dtype, indices, offloaded in parts:
            smallest = min(t.itemsize for t in (dtype, grad_dtype, sync_dtype))
            bucket_numel = int(config.bucket_cap_mb * 2**20) // grad_dtype.itemsize
            layout = self.layouts[gi].plan(
                [(i, tuple(self.params[i].shape)) for i in indices],
                world_size=self.world_size,
                bucket_numel=max(bucket_numel, 1),
                align_numel=config.storage.align_numel(ALIGN_BYTES // smallest),
            )
            plans.append((gi, dtype, grad_dtype, sync_dtype, offloaded, layout))
        return plans

    def _build_keys(self, plans: list[tuple], state_names, state_signed) -> list[Key]:
        """The buffers of every planned key."""
        config = self.config
        keys = []
        for gi, dtype, grad_dtype, sync_dtype, offloaded, layout in plans:
            buffers = KeyBuffers(
                layout,
                self.rank,
                device=self.device,
                param_dtype=dtype,
                grad_sync_dtype=grad_dtype,
                param_sync_dtype=sync_dtype,
                storage=config.storage,
                state_names=state_names,
                state_signed=state_signed,
                persistent_grads=config.nccl_ub,
                comm_allocating=self.allocating,
                offloaded=offloaded,
                huge_pages=config.offload_huge_pages,
            )
            keys.append(Key(len(keys), gi, dtype, layout, buffers))
        return keys

    @torch.no_grad()
    def _bind(self) -> None:
        """Params become views of their key's param buffer; masters start from the params."""
        #: engine param -> the buffer view it must be (see ``check_bindings``)
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for key in self.keys:
            buf = key.buffers
            for i in key.layout.params:
                p = self.params[i]
                view = buf.param_view(i, p.shape)
                view.copy_(p.data)
                p.data = view
                self.views[i] = view
            if buf.offloaded and buf.master_kind != "copy":
                host_state.pull_params(buf)  # the host copy of the params' chunks
            if buf.master_kind != "copy":  # the params' chunks are (the top halves of) masters
                continue
            for f, master in zip(buf.fragments, buf.per_fragment(buf.master)):
                master.copy_(buf.fragment_param_view(self.params[f.param].data, f))
        self._view_ptrs = [v.data_ptr() for v in self.views]
        self.note_params_published()

    # -- params changed after construction (see Note: the params are the truth) ------------------

    def note_params_published(self) -> None:
        """Remembers the params' version counters once the optimizer wrote them, so
        ``refresh_masters`` sees any later write through a param (a param re-bound with
        ``p.data = view`` keeps its own counter: the optimizer's writes into the buffer do not
        move it, a user's write into the param does)."""
        self._versions = [p._version for p in self.params]

    def check_bindings(self) -> list[int]:
        """Re-binds params that were re-bound to other tensors of the same shape, dtype and
        device (``p.data = ...``, a framework's prepare step); returns their indices. Raises,
        naming the param, when a param can no longer be a view of its buffer."""
        rebound = []
        for i, (p, ptr) in enumerate(zip(self.params, self._view_ptrs)):
            if p.data_ptr() == ptr:  # the hot path: one call per param
                continue
            view = self.views[i]
            if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                raise ParamReboundError(
                    self.all_index[i],
                    f"{self.owner}: param {self.all_index[i]} was replaced after the optimizer "
                    f"was built by a tensor of another shape, dtype or device ({tuple(p.shape)} "
                    f"{p.dtype} on {p.device}; the optimizer holds {tuple(view.shape)} "
                    f"{view.dtype} on {view.device}); move or cast the model before building "
                    "the optimizer",
                )
            with torch.no_grad():
                view.copy_(p.data)
                p.data = view
            rebound.append(i)
        return rebound

    def _written(self) -> set[int]:
        """Engine params written or re-bound since the optimizer last wrote them."""
        changed = set(self.check_bindings())
        for i, (p, seen) in enumerate(zip(self.params, self._versions)):
            if p._version != seen:
                changed.add(i)
        return changed

    @torch.no_grad()
    def pull_written_params(self) -> None:
        """CPU offload, before state I/O: the host copies of the params of ``param`` and
        ``remainder`` keys follow params written since (``model.load_state_dict`` before the
        optimizer's load), as the params themselves are those masters without offload; with
        ``force`` (after state I/O wrote the host copies) ``refresh_masters`` leaves them."""
        changed_keys = {self.param_key[i].index for i in self._written()}
        for key in self.keys:
            buf = key.buffers
            if buf.offloaded and buf.master_kind != "copy" and key.index in changed_keys:
                host_state.pull_params(buf)

    @torch.no_grad()
    def refresh_masters(self, force: bool = False) -> None:
        """Re-seeds the masters of params written (or re-bound) since the optimizer last wrote
        them (every master if ``force``): a master copy is kept where it still rounds to the
        param, else it becomes the param's value; a written param's int16 remainders are reset
        (the written values carry none; ``force`` leaves them: state I/O already kept the loaded
        ones only where they round to the param). Params that are their own masters need
        nothing."""
        changed = self._written()
        changed_keys = {self.param_key[i].index for i in changed}
        for key in self.keys:
            buf = key.buffers
            if buf.master_kind == "copy" and (force or key.index in changed_keys):
                for f, master in zip(buf.fragments, buf.per_fragment(buf.master)):
                    param = buf.fragment_param_view(self.params[f.param].data, f)
                    master.copy_(merge_master(master, param, buf.sync_space.dtype))
                continue
            if buf.offloaded and not force and key.index in changed_keys:
                host_state.pull_params(buf)  # the host copy follows the params
            if buf.master_kind == "remainder" and not force and key.index in changed_keys:
                for f in buf.fragments:
                    if f.param in changed:
                        buf.fragment(buf.remainder, f).zero_()
        self.note_params_published()


def merge_master(
    master: torch.Tensor, param: torch.Tensor, sync_dtype: torch.dtype
) -> torch.Tensor:
    """The master to keep for ``param``: the master where it still rounds (to the dtype params are
    gathered in, or through the bits an integer sync dtype carries) to the param's value, else
    the param's value (see Note: the params are the truth)."""
    param = param.to(master.device)  # an offloaded master lives on the host
    if sync_dtype.is_floating_point:
        rounded = master.to(sync_dtype).to(param.dtype)
    else:  # Apex's bit copy: the param holds the bits the sync element carries
        bits = torch.empty(master.shape, dtype=sync_dtype, device=master.device)
        write_sync(bits, master, param.dtype)
        rounded = torch.empty_like(param)
        sync_to_params(rounded, bits)
    return torch.where(rounded == param, master, param.to(master.dtype))
