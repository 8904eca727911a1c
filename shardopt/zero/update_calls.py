"""Which shard elements each update-kernel call of a step covers (see Note: skipped params).

Note: skipped params
    torch.optim skips a param whose ``.grad`` is None: value, state and its own step stay as they
    are. Under DDP(find_unused_parameters=True) that is a param no rank computed a grad for. The
    engine learns those params from one small all-reduce per step (``GradSync.unused_params``;
    off with ``skip_unused_params=False`` and under ``capturable``, where such params get a
    zero-grad update) and leaves their fragments out of the kernel calls. A param's own step is
    its group's step minus the steps it skipped (its *offset*); fragments are grouped by offset
    so every kernel call gets one ``step_t``. When no param skipped anything (the usual case) a
    key is updated bucket by bucket, one call over whole chunks; otherwise elementwise rules take
    runs of adjacent fragments (alignment gaps included: zero grads and zero state stay zero)
    and per-tensor rules (LAMB, NovoGrad) take fragments.

Note: planned calls are kept
    Without skipped params a key's calls depend only on its layout and the rank, so they are
    planned once per key (and per shard window: the offload worker asks for one bucket's calls
    twice per bucket, and planning walks every bucket of the key) and the same Call objects are
    handed out again (never mutated). With skipped params they are planned per step. Planning
    every time made the offloaded update's bookkeeping grow with buckets x buckets per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardopt.algorithms.step_args import device_scalar
from shardopt.zero.flat_buffer import KeyBuffers, Shard
from shardopt.zero.layout import Range
from shardopt.zero.sharded_params import Key, ShardedParams
from shardopt.zero.state_storage import blocks


@dataclass
class Call:
    """One kernel call over a key's shard: shard ranges (each within one bucket's chunk), the
    key-space ranges its out slot writes, and the steps its params skipped."""

    buffers: KeyBuffers
    shard_ranges: list[Range]
    space_ranges: list[Range]
    offset: int
    index: torch.Tensor | None  # engine param of each range (per-tensor rules)

    def of(self, shard: Shard) -> list[torch.Tensor]:
        """The call's views of a shard (grad shard, master, a state)."""
        return self.buffers.views(shard, self.shard_ranges)

    def blocks_of(self, scales: torch.Tensor) -> list[torch.Tensor]:
        """The call's views of a per-block scale shard (blockwise state formats)."""
        return [scales.narrow(0, b.start, b.numel) for b in map(blocks, self.shard_ranges)]

    def outs(self) -> list[torch.Tensor] | None:
        """The out slot (low-precision params or another sync dtype), None when the master IS
        the param (updated in place) or the engine writes the sync space (``out_by_copy``)."""
        buf = self.buffers
        if buf.master_is_param or buf.out_by_copy:
            return None
        if buf.offloaded:  # the host out slot, in shard coordinates (host_state.py)
            if buf.host_out is None:  # a remainder key: the update writes its host params
                return None
            return buf.views(buf.host_out, self.shard_ranges)
        return [buf.sync_space.narrow(0, r.start, r.numel) for r in self.space_ranges]

    def within(self, window: Range) -> Call:
        """The part of this call inside shard range ``window`` (one bucket's chunk: every range
        of a call lies within one chunk, so a range is wholly in or out)."""
        keep = [
            j
            for j, r in enumerate(self.shard_ranges)
            if r.start >= window.start and r.end <= window.end
        ]
        index = self.index
        if index is not None and len(keep) != len(self.shard_ranges):
            index = index[torch.tensor(keep, dtype=torch.long, device=index.device)]
        return Call(
            self.buffers,
            [self.shard_ranges[j] for j in keep],
            [self.space_ranges[j] for j in keep],
            self.offset,
            index,
        )

    def step_t(self, group: dict) -> torch.Tensor:
        """The params' own step (a tensor where the update runs): the group's minus the skipped
        steps."""
        step = device_scalar(group["step"], self.buffers.update_device)
        return step - self.offset if self.offset else step


class UpdateCalls:
    """Plans each step's kernel calls and keeps every param's count of skipped steps."""

    def __init__(self, sharded: ShardedParams) -> None:
        self.sharded = sharded
        #: engine param -> steps it was skipped (no grad on any rank)
        self.offsets = [0] * len(sharded.params)
        self.unused: frozenset[int] = frozenset()
        #: (key, shard range) the calls are limited to, see ``within``
        self.window: tuple[Key | None, Range | None] | None = None
        #: Note: planned calls are kept: (key index, per_tensor[, window]) -> (key, calls)
        self._kept: dict[tuple, tuple[Key, list[Call]]] = {}
        #: key index -> (the unused params it was made for, ``used_mask``): like the calls, a
        #: view of this plan's keys, so it goes with them when a re-plan (offload_replan.py)
        #: builds new ones
        self._used: dict[int, tuple[frozenset[int], torch.Tensor]] = {}

    @contextlib.contextmanager
    def within(self, key: Key | None, shard: Range | None) -> Iterator[None]:
        """Inside, ``calls`` covers only shard range ``shard`` of ``key`` (key None: only the
        keys that are not offloaded); see Note: the offloaded step in offload_pipeline.py."""
        self.window = (key, shard)
        try:
            yield
        finally:
            self.window = None

    @property
    def any_skipped(self) -> bool:
        return bool(self.unused) or any(self.offsets)

    def begin(self, unused: frozenset[int]) -> None:
        self.unused = unused

    def end(self, found_inf_t: torch.Tensor | None) -> None:
        """Counts this step as skipped for the unused params (unless the whole step was)."""
        if not self.unused:
            return
        if found_inf_t is not None and bool(found_inf_t.item()):
            return
        for i in self.unused:
            self.offsets[i] += 1

    def used_mask(self, key: Key) -> torch.Tensor:
        """Whether each param of ``key`` (in layout order) has a grad this step: a bool mask on
        the device, copied there once per set of unused params, not every step."""
        kept = self._used.get(key.index)
        if kept is None or kept[0] != self.unused:
            used = [i not in self.unused for i in key.layout.params]
            mask = torch.tensor(used, device=self.sharded.device)
            kept = self._used[key.index] = (self.unused, mask)
        return kept[1]

    def step_offsets(self) -> torch.Tensor | None:
        """Per engine param offsets on the device (None when all are zero)."""
        if not any(self.offsets):
            return None
        return torch.tensor(self.offsets, dtype=torch.float32, device=self.sharded.device)

    def calls(self, key: Key, per_tensor: bool) -> list[Call]:
        window = None
        if self.window is not None:
            only, window = self.window
            if only is None:  # the keys that are not offloaded
                return [] if key.buffers.offloaded else self._whole(key, per_tensor)
            if key is not only:
                return []
        if window is None:
            return self._whole(key, per_tensor)
        if self.any_skipped:
            return _within(self._planned(key, per_tensor), window)
        tag = (key.index, per_tensor, window.start, window.end)
        return self._keep(tag, key, lambda: _within(self._whole(key, per_tensor), window))

    def _whole(self, key: Key, per_tensor: bool) -> list[Call]:
        """The key's calls outside any window (kept when nothing is skipped)."""
        if self.any_skipped:
            return self._planned(key, per_tensor)
        return self._keep((key.index, per_tensor), key, lambda: self._planned(key, per_tensor))

    def _keep(self, tag: tuple, key: Key, plan) -> list[Call]:
        """The calls kept under ``tag`` for ``key``, planned by ``plan()`` the first time (see
        Note: planned calls are kept)."""
        kept = self._kept.get(tag)
        if kept is None or kept[0] is not key:
            kept = self._kept[tag] = (key, plan())
        return list(kept[1])

    def _planned(self, key: Key, per_tensor: bool) -> list[Call]:
        buf = key.buffers
        buckets = key.layout.buckets
        if not self.any_skipped:
            if per_tensor:
                return [
                    Call(
                        buf,
                        [f.shard_range for f in buf.fragments],
                        [_space(f.bucket_range, buckets[f.bucket]) for f in buf.fragments],
                        0,
                        self.sharded.fragment_indices[key.index],
                    )
                ]
            chunks = [
                (
                    Range(b.shard_offset, b.shard_offset + b.chunk_numel),
                    _space(b.chunk_range(self.sharded.rank), b),
                )
                for b in buckets
            ]
            return [Call(buf, [s for s, _ in chunks], [k for _, k in chunks], 0, None)]
        by_offset: dict[int, list] = {}
        for position, f in enumerate(buf.fragments):
            if f.param not in self.unused:
                by_offset.setdefault(self.offsets[f.param], []).append((position, f))
        calls = []
        for offset, frags in sorted(by_offset.items()):
            index = None
            if per_tensor:
                index = torch.tensor(
                    [f.param for _, f in frags], dtype=torch.long, device=self.sharded.device
                )
                runs = [(f.shard_range, f.bucket_range, f.bucket) for _, f in frags]
            else:
                runs, last = [], None
                for position, f in frags:  # merge neighbours (only gaps between) of one bucket
                    if last is not None and last == position - 1 and runs[-1][2] == f.bucket:
                        shard_r, bucket_r, _ = runs[-1]
                        runs[-1] = (
                            Range(shard_r.start, f.shard_range.end),
                            Range(bucket_r.start, f.bucket_range.end),
                            f.bucket,
                        )
                    else:
                        runs.append((f.shard_range, f.bucket_range, f.bucket))
                    last = position
            calls.append(
                Call(
                    buf,
                    [s for s, _, _ in runs],
                    [_space(r, buckets[b]) for _, r, b in runs],
                    offset,
                    index,
                )
            )
        return calls


def _within(calls: list[Call], window: Range) -> list[Call]:
    """The parts of ``calls`` inside shard range ``window``."""
    return [c for c in (call.within(window) for call in calls) if c.shard_ranges]


def _space(bucket_range: Range, bucket) -> Range:
    """Key-space range of a bucket range."""
    return bucket_range.shift(bucket.space_range.start)


def sum_by_param(out: torch.Tensor, index: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Adds each per-range value of ``values`` (one tensor per call, on ``out``'s device) into
    ``out`` at its param (``index``: the calls' ``Call.index``), in one pass whose order does not
    vary from run to run. A param spans several calls when it spans buckets; ``index_add_`` on
    CUDA adds such duplicates with atomics, in an order that varies (LAMB's trust ratios and
    NovoGrad's norms then differed in the last bit between runs, and between a GPU update and
    the CPU update of an offloaded key: seen on an H200). ``index_put_(accumulate=True)`` sorts
    the indices and adds each param's values in one thread: on the CPU in call and range order
    from the value in ``out``; on CUDA in its kernel's own order (another rounding than the
    CPU's, the same every run)."""
    if index:
        out.index_put_((torch.cat(index),), torch.cat(values), accumulate=True)
