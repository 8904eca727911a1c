"""Apex ``DistributedFusedAdam``'s constructor and method surface on the distributed optimizers.

Apex scripts switch by changing the import: its keyword arguments are accepted with Apex's
defaults and meanings where shardopt has the same mechanism, mapped where shardopt has an
equivalent one, and refused with a ``NotImplementedError`` that names the argument where the
meaning cannot be kept. See docs/migration.md ("From Apex").

Mapping (Apex argument -> shardopt):
  - ``process_group`` + ``distributed_process_group``: Apex's ``process_group`` is the whole
    group (shards x replicas) and ``distributed_process_group`` the sharding group; given the
    latter, it shards the state and the former must have ``distributed x redundant`` ranks;
  - ``pipeline_size`` (2): grad-bucket reduce-scatters in flight during backward;
  - ``contiguous_param_buffer``: params are always views of one flat buffer per key (Apex's
    True); False is accepted (no setting keeps separate param storage);
  - ``contiguous_grad_buffer``: grads always go through transient per-bucket buffers (less
    memory than either Apex mode); both values are accepted;
  - ``store_params`` (True): fp32 params gathered in fp32 never keep a separate master (Apex's
    False); low-precision params always keep an fp32 master (Apex's True); both accepted;
  - ``store_param_remainders``, ``with_scaled_states``: Apex's meanings (int16 remainders instead
    of fp32 masters for bf16 params; 16-bit moments with per-block scales), on
    DistributedFusedAdam (see Note: compact storage in state_storage.py); the other classes
    refuse them;
  - ``nccl_ub``: Apex's meaning: the buffers of the collectives come from an NCCL-registered
    memory pool (shardopt/zero/apex/user_buffers.py: torch's NCCL allocator, else shardopt's own),
    with persistent grad buffers as Apex's contiguous grad buffer; needs NCCL groups;
  - ``init_params(params, grad_sync_dtype=..., param_sync_dtype=...)``: Apex's per-param
    dtypes: those params get keys (buckets) of their own, the layout is re-planned (before the
    first backward);
  - ``device``: must be the params' device.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardopt.zero import comm, foreign_args, sharded_params
from shardopt.zero.settings import check_settings

#: Apex keyword -> its default (every one accepted by the distributed classes)
APEX_DEFAULTS: dict[str, Any] = {
    "distributed_process_group": None,
    "device": None,
    "pipeline_size": 2,
    "contiguous_param_buffer": False,
    "contiguous_grad_buffer": False,
    "store_params": True,
    "store_param_remainders": False,
    "with_scaled_states": False,
    "nccl_ub": False,
}

#: below this share of bucket space holding params, construction warns (Apex's threshold)
BUCKET_FILL_WARNING = 0.7


def resolve(owner: str, process_group, apex: dict[str, Any]) -> dict[str, Any]:
    """Validates the Apex keywords; returns ``process_group`` (the sharding group) and
    ``pipeline_size`` for the engine."""
    unknown = set(apex) - set(APEX_DEFAULTS)
    if unknown:
        raise foreign_args.unknown_keywords_error(owner, unknown)
    opts = {**APEX_DEFAULTS, **apex}
    pipeline = opts["pipeline_size"]
    if not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"{owner}: pipeline_size must be a positive int, got {pipeline!r}")
    shard_group = process_group
    distributed = opts["distributed_process_group"]
    if distributed is not None:
        shard_group = distributed
    return {
        "process_group": shard_group,
        "pipeline_size": pipeline,
        "device": opts["device"],
        "store_param_remainders": bool(opts["store_param_remainders"]),
        "with_scaled_states": bool(opts["with_scaled_states"]),
        "nccl_ub": bool(opts["nccl_ub"]),
    }


def check_apex_groups(owner: str, whole, shard, redundant) -> None:
    """With Apex's ``distributed_process_group``, ``process_group`` is shards x replicas."""
    if whole is None or whole is shard:
        return
    expected = comm.world_size(shard) * (comm.world_size(redundant) if redundant else 1)
    if comm.world_size(whole) != expected:
        raise ValueError(
            f"{owner}: process_group has {comm.world_size(whole)} ranks, but "
            f"distributed_process_group x redundant_process_group is {expected}"
        )


def check_device(owner: str, device, params_device: torch.device) -> None:
    if device is None:
        return
    wanted = torch.device(device)
    same = wanted.type == params_device.type and (
        wanted.index is None or wanted.index == params_device.index
    )
    if not same:
        raise ValueError(
            f"{owner}: device={device!r} but the params are on {params_device}; move the model "
            "first"
        )


def apex_bucket_fill(
    params: list[tuple[int, torch.dtype, torch.dtype]], bucket_cap_mb: float, world_size: int
) -> tuple[int, int]:
    """(filled, capacity) elements of Apex's buckets for ``params`` (numel, grad-sync dtype,
    param-sync dtype), in param-group order.

    Apex's measure, not shardopt's layout: params of every param group with the same dtypes fill
    shared buckets in order, each start 128-byte aligned; a bucket holds ``bucket_cap_mb`` MiB
    of grad-sync dtype cut into equal shards rounded down to the alignment (one alignment at
    least), and a new bucket opens only when a param does not fit (a param may span buckets).
    A bucket's fill ends at its last param.
    """
    open_buckets: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}  # dtypes -> fills
    sizes: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for numel, grad_dtype, sync_dtype in params:
        dtypes = (grad_dtype, sync_dtype)
        align = max(128 // grad_dtype.itemsize, 1)
        if dtypes not in sizes:
            shard = int(bucket_cap_mb * 2**20 / grad_dtype.itemsize / world_size)
            sizes[dtypes] = max(shard // align * align, align) * world_size
            open_buckets[dtypes] = [0]
        fills, size = open_buckets[dtypes], sizes[dtypes]
        start = 0
        while start < numel:
            begin = -(-fills[-1] // align) * align
            piece = min(numel - start, size - begin)
            if piece <= 0:
                fills.append(0)
                continue
            fills[-1] = begin + piece
            start += piece
    filled = sum(sum(f) for f in open_buckets.values())
    capacity = sum(len(open_buckets[d]) * sizes[d] for d in open_buckets)
    return filled, capacity


def warn_underfilled(owner: str, keys, bucket_cap_mb: float, world_size: int) -> None:
    """Apex's warning when the params fill less than 70% of Apex's buckets
    (``apex_bucket_fill``), with a ``bucket_cap_mb`` that would fill them where one exists.

    shardopt's last bucket of a key is only as long as its params, so a large cap costs no
    memory here; what it costs is overlap: a model in one bucket reduce-scatters its grads only
    after the whole backward. Scripts (and Apex's tests) take the warning as the sign to lower
    ``bucket_cap_mb``; Apex's measure keeps the warning where Apex gives it.
    """
    per_param = sorted(
        (i, n.numel, k.buffers.grad_dtype, k.buffers.sync_space.dtype)
        for k in keys
        for i, n in k.layout.space_ranges.items()
    )
    params = [entry[1:] for entry in per_param]
    filled, capacity = apex_bucket_fill(params, bucket_cap_mb, world_size)
    if not capacity or filled / capacity >= BUCKET_FILL_WARNING:
        return
    ratio = filled / capacity
    largest: dict[tuple, int] = {}
    for numel, grad_dtype, sync_dtype in params:
        largest[grad_dtype, sync_dtype] = largest.get((grad_dtype, sync_dtype), 0) + numel * (
            grad_dtype.itemsize
        )
    whole_mb = max(largest.values()) / 2**20
    advice = ""
    for parts in range(1, 17):  # the largest cap below the current one that fills the buckets
        cap = float(f"{whole_mb * 1.01 / parts:.3g}")
        if cap < bucket_cap_mb:
            fill = apex_bucket_fill(params, cap, world_size)
            if fill[0] / fill[1] >= BUCKET_FILL_WARNING:
                advice = f" (bucket_cap_mb={cap:g} fills {fill[0] / fill[1]:.0%})"
                break
    warnings.warn(
        f"{owner}: the params fill only {ratio:.1%} of the bucket capacity (fill ratio "
        f"{ratio:.3f}, {filled} of {capacity} elements of buckets of {bucket_cap_mb:g} MB, "
        f"counted as Apex counts them; below {BUCKET_FILL_WARNING:.0%}): fewer, larger buckets "
        "overlap less of the grad sync with backward. Consider decreasing the bucket_cap_mb "
        f"argument.{advice}",
        stacklevel=5,  # the line constructing the optimizer (through __init__ and _build)
    )


class ApexSurface:
    """Mixin of ``DistributedOptimizer``: Apex's methods over shardopt's eager layout."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every param of the optimizer, in param-group order (Apex's ``parameters()``)."""
        yield from self.all_params

    def init_params(
        self,
        params: Iterable[torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
        grad_sync_dtype: torch.dtype | None = None,
        param_sync_dtype: torch.dtype | None = None,
        **kwargs,
    ) -> None:
        """Apex's explicit initialisation, with Apex's per-param dtypes.

        shardopt plans every param at construction (in registration order, reversed into
        buckets), so without dtypes this checks that ``params`` belong to the optimizer. With
        ``grad_sync_dtype`` / ``param_sync_dtype`` other than those in use, ``params`` get their
        own keys (buckets) in those dtypes and the layout is re-planned: one optimizer may sync
        some params in bf16 and others in fp32. That must happen before the first backward.
        Collective (as Apex scripts call it, on every rank): ranks asking for different dtypes
        all raise.
        ``dtype`` (the state dtype) is per optimizer: another value raises NotImplementedError.

        Args:
            params: a param, params of this optimizer, or None for all of them.
            dtype: the optimizer state dtype (must be the one in use).
            grad_sync_dtype: dtype these params' grads are accumulated and reduce-scattered in.
            param_sync_dtype: dtype these params are all-gathered in (an integer dtype: Apex's
                bit copy, see Note: integer sync in shardopt/zero/sync_bits.py).
            **kwargs: ignored (Apex's internal arguments).
        """
        if isinstance(params, torch.Tensor):
            params = [params]
        chosen = list(params) if params is not None else self.all_params
        changed, error = {}, None
        try:  # collective below: an error on one rank must reach every rank, not hang them
            self._check_init(chosen, "init_params")
            owner = type(self).__name__
            if dtype is not None and dtype != self.config.state_dtype:
                raise NotImplementedError(
                    f"{owner}.init_params: dtype={dtype} differs from the "
                    f"{self.config.state_dtype} in use; the optimizer state dtype is set per "
                    "optimizer, not per param"
                )
            changed = self._dtype_changes(chosen, grad_sync_dtype, param_sync_dtype)
        except (TypeError, ValueError, NotImplementedError) as e:
            error = e
        comm.raise_if_any(error, self.process_group)
        replan(self, changed)

    def _dtype_changes(self, chosen, grad_sync_dtype, param_sync_dtype) -> dict:
        """{engine param index: (grad-sync, param-sync dtype)} of the params whose dtypes change."""
        for asked in (grad_sync_dtype, param_sync_dtype):
            if asked is not None and not isinstance(asked, torch.dtype):
                raise TypeError(
                    f"{type(self).__name__}.init_params: sync dtypes must be torch dtypes, got "
                    f"{asked!r}"
                )
        sharded = self.sharded
        dtypes_of = self.config.sync_dtypes()
        changed = {}
        for p in chosen:
            i = sharded.param_index.get(id(p))
            if i is None:  # frozen: never synced
                continue
            key = sharded.param_key[i]
            now = (key.buffers.grad_dtype, key.buffers.sync_space.dtype)
            grad, sync = dtypes_of(i, p.dtype)
            want = (grad_sync_dtype or grad, param_sync_dtype or sync)
            if not want[1].is_floating_point and want[1].itemsize == p.dtype.itemsize:
                want = (want[0], p.dtype)  # the same bits as the param dtype
            if want != now:
                changed[i] = want
        return changed

    def init_params_bucket(self, params: Iterable[torch.Tensor]) -> None:
        """Apex's bucket-aligned initialisation: checks the params belong to the optimizer
        (the layout is planned at construction; buckets follow registration order)."""
        self._check_init(params, "init_params_bucket")

    def _check_init(self, params, method: str) -> None:
        if params is None:
            return
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        mine = {id(p) for p in self.all_params}
        for p in params:
            if id(p) not in mine:
                raise ValueError(
                    f"{type(self).__name__}.{method}: a param {tuple(p.shape)} is not one of "
                    "this optimizer's params"
                )


def replan(self, per_param: dict[int, tuple[torch.dtype, torch.dtype]]) -> None:
    """``init_params`` of the optimizer ``self`` with other dtypes for some params (none: nothing
    to do): re-plans every key with them, before any grad arrived (nothing but the params' values
    to carry over). Collective: every rank must ask for the same."""
    name = type(self).__name__
    error = None
    started = per_param and (
        any(float(g["step"]) > 0 for g in self.param_groups)
        or self.grad_sync.iteration.arrived
        or any(k.buffers.grad_buckets for k in self.keys)
    )
    if started:
        error = RuntimeError(
            f"{name}.init_params: per-param dtypes must be set before the first backward "
            "(the params are then planned into buckets of those dtypes); this optimizer "
            "already received grads"
        )
    elif per_param and self._user_buffers is not None:
        error = NotImplementedError(
            f"{name}.init_params: per-param dtypes with nccl_ub=True (the registered pool "
            "was sized for the layout planned at construction); pass the dtypes to the "
            "constructor or build one optimizer per dtype"
        )
    for grad_dtype, sync_dtype in per_param.values():
        try:
            check_settings(
                name, grad_dtype, sync_dtype, self.capturable, self.overlap_param_sync,
                self.bucket_cap_mb,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            error = error or e
    comm.raise_if_any(error, self.process_group)
    asked = comm.all_gather_object(sorted(per_param.items()), self.process_group)
    if any(other != asked[0] for other in asked):
        raise ValueError(
            f"{name}.init_params: the per-param dtypes asked for differ between ranks (every "
            "rank must call init_params with the same params and dtypes)"
        )
    if not per_param:
        return
    merged = {i: (g, s) for i, g, s in self.config.per_param}
    merged.update(per_param)
    self.param_sync.close()
    self.grad_sync.remove_hooks()
    sharded_params.release(self.params, self)
    self.config = dataclasses.replace(
        self.config, per_param=tuple((i, g, s) for i, (g, s) in sorted(merged.items()))
    )
    self._build(name)
