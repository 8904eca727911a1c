"""The contiguous buffers of one key and the views the engine hands out (see Note: buckets and
shards in docs/design.md).

Per key:
  - ``param_space``: the params themselves, back to back in the key space (params are rebound to
    its memory, so an all-gather writes straight into the params; see Note: a param's own
    storage);
  - ``sync_space``: the all-gather buffer when ``param_sync_dtype`` differs from the param dtype
    (else the same tensor as ``param_space``);
  - grad buckets: TRANSIENT per-bucket gradient buffers in the grad-sync dtype, allocated when a
    bucket's first gradient arrives and released once its reduce-scatter is done (they live across
    backward passes only under ``no_sync``); there is no full-size gradient buffer;
  - ``grad_shard``: this rank's reduce-scattered (summed) gradient chunks, also transient: allocated
    by the first reduce-scatter of an iteration and released at the end of ``step()``;
  - ``master`` and one tensor per optimizer state: this rank's shard (see Note: compact storage
    in state_storage.py for the kinds and formats). When the params are their own masters (fp32
    params gathered in fp32) the master is not a copy: it is this rank's chunks of
    ``param_space`` (a ``ChunkedShard``), so the kernel updates the params in place and the
    all-gather runs in place; with int16 remainders the master is those chunks plus
    ``remainder``; blockwise state formats add per-block ``scales``.

A shard is either a flat tensor or a ``ChunkedShard``; take views of it only through
``shard_slice`` / ``shard_of_bucket`` / ``per_bucket`` / ``per_fragment``.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from shardopt import state_codec
from shardopt.zero.layout import Bucket, Fragment, KeyLayout, Range
from shardopt.zero.offload import host_memory
from shardopt.zero.state_storage import Storage

#: Note: views kept for the update thread. An offloaded key's update runs bucket by bucket on
#: the offload worker's update thread (offload_worker.py), the critical path of an offloaded
#: step, and every torch op called from Python there (a ``narrow`` per state tensor and range)
#: releases the GIL and must take it back: while the training loop's thread runs Python (the next
#: forward) each such op waits for it, up to the switch interval. The views of a shard an update
#: call reads (the host state's, the staging slots') do not change from step to step, so an
#: offloaded key keeps them: ``KeyBuffers.views`` hands out the same view objects for the same
#: shard object and ranges, for the shards that live as long as the key (its host state, the
#: pipeline's slots as ``ChunkedShard(kept=True)``), never for a shard made per step (a
#: whole-shard update's staged grads: kept views would keep it). A kept entry holds its shard,
#: so an id is never reused while its entry lives; calls planned per step (skipped params) have
#: ranges of their own, and the entries are dropped once ``VIEWS_KEPT`` (plus 16 a bucket: a
#: bucket's state views and its views of each slot it meets) are kept. With the
#: step's count shaped for the kernels once per step (``frozen_view``, ``Call.step_t``), no torch
#: op is left between two kernel calls of the update thread but the wait for the grads' copy
#: (only when it is not done: ``OffloadPipeline._update``). On this 2-core CPU machine (64
#: buckets of 66K params, one update thread beside the training loop; three runs each) the time
#: of a bucket's update outside its kernel call went from 0.17-0.27 ms to 0.07 ms, the whole
#: update from 0.29-0.43 to 0.26-0.32 ms: the GIL wait when the kernel call returns is left.
VIEWS_KEPT = 4096

#: Note: a param's own storage. Savers that deduplicate tensors by storage take views of one storage
#: for tied weights: with the params plain views of ``param_space``, Accelerate's ``save_state``
#: (safetensors) wrote one param per key ("Removed shared tensor ... while saving") and its
#: ``load_state`` failed, safetensors' ``save_model`` refused to save, and transformers'
#: ``save_pretrained`` cloned every param first. So a param is bound to ``torch.from_dlpack`` of its
#: view: the same memory (the optimizer and the all-gathers still write the params in place), a
#: storage object of exactly the param's bytes, and the DLPack deleter keeps ``param_space`` alive.
#: No copy, no extra memory; ``torch.save`` writes each param's bytes (not the whole buffer once).
#: Tested in tests/integrations/test_integrations_checkpoint.py.


def _view(t: torch.Tensor, r: Range) -> torch.Tensor:
    return t.narrow(0, r.start, r.numel)


class ChunkedShard:
    """A rank's shard made of one chunk per bucket of a key-space tensor (not contiguous)."""

    def __init__(self, chunks: list[torch.Tensor], offsets: list[int], kept: bool = False) -> None:
        self.chunks = chunks
        self.offsets = offsets  # shard offset of each chunk, increasing
        #: the object lives as long as its key and is used again (a staging slot's): its views
        #: are kept (Note: views kept for the update thread)
        self.kept = kept

    @property
    def dtype(self) -> torch.dtype:
        return self.chunks[0].dtype

    @property
    def device(self) -> torch.device:
        return self.chunks[0].device

    def slice(self, r: Range) -> torch.Tensor:
        """Shard elements ``r``, which must lie within one chunk."""
        i = bisect.bisect_right(self.offsets, r.start) - 1
        if i < 0 or r.end - self.offsets[i] > self.chunks[i].numel():
            raise IndexError(f"shard range {r} is not inside one bucket's chunk")
        return _view(self.chunks[i], r.shift(-self.offsets[i]))


Shard = torch.Tensor | ChunkedShard


class KeyBuffers:
    """Owns the flat tensors of one key on one rank."""

    def __init__(
        self,
        layout: KeyLayout,
        rank: int,
        *,
        device: torch.device,
        param_dtype: torch.dtype,
        grad_sync_dtype: torch.dtype,
        param_sync_dtype: torch.dtype,
        storage: Storage,
        state_names: tuple[str, ...],
        state_signed: dict[str, bool] | None = None,
        persistent_grads: bool = False,
        comm_allocating: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        offloaded: bool = False,
        huge_pages: bool = False,
    ) -> None:
        self.layout = layout
        #: CPU offload (host_state.py): master, state, remainder and scales live in host memory
        #: and the update runs there; the params, sync space and grads stay on ``device``
        self.offloaded = offloaded
        #: where the update kernels run and the state lives
        self.update_device = torch.device("cpu") if offloaded else device
        state_device = self.update_device

        def full(numel: int, dtype: torch.dtype, value: int | float = 0) -> torch.Tensor:
            """A state tensor: on the host (Note: huge pages for host state) when offloaded."""
            if offloaded:
                return host_memory.full(numel, dtype, value, huge_pages)
            return torch.full((numel,), value, dtype=dtype, device=state_device)

        self.rank = rank
        self.device = device
        self.grad_dtype = grad_sync_dtype
        self.storage = storage
        space, shard = layout.space_numel, layout.shard_numel
        with comm_allocating():  # what the all-gathers write
            self.param_space = torch.zeros(space, dtype=param_dtype, device=device)
            self.sync_space = (
                self.param_space
                if param_sync_dtype == param_dtype
                else torch.zeros(space, dtype=param_sync_dtype, device=device)
            )
        self._grad_shard: torch.Tensor | None = None
        #: see Note: compact storage (state_storage.py): ``param``, ``copy`` or ``remainder``
        self.master_kind = storage.master_kind(param_dtype, param_sync_dtype)
        #: the master IS this rank's chunks of the params (updated in place, no copy)
        self.master_is_param = self.master_kind == "param"
        if self.master_kind == "copy":
            self.master: Shard = full(shard, torch.float32)
        elif offloaded and self.master_kind == "param":  # a host copy of the param chunks
            self.master = full(shard, param_dtype)
        else:
            self.master = ChunkedShard(
                self.chunks(self.param_space), [b.shard_offset for b in layout.buckets]
            )
        #: the kernels cannot write this sync dtype (fp64, integer bits): the engine copies the
        #: masters into ``sync_space`` after the update (``write_sync``)
        self.out_by_copy = self.master_kind == "copy" and param_sync_dtype not in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        )
        #: the int16 low halves of the fp32 masters of a ``remainder`` key
        self.remainder = full(shard, torch.int16) if self.master_kind == "remainder" else None
        fmt = storage.state_format
        self.state_signed = {n: True for n in state_names} | dict(state_signed or {})
        self.state = {  # zero state (codes of 0.0: the 8-bit map's zero is not code 0)
            n: full(
                shard,
                state_codec.code_dtype(fmt),
                state_codec.zero_code(self.state_signed[n]) if fmt == "int8" else 0,
            )
            for n in state_names
        }
        #: per-block fp32 scales of blockwise formats (zero scales decode to zero)
        self.scales = (
            {n: full(state_codec.num_blocks(shard), torch.float32) for n in state_names}
            if storage.blockwise
            else {}
        )
        self.fragments = layout.rank_fragments(rank)
        #: offloaded keys, during a step: the host copy of the grad shard and the host out slot
        #: the kernels write the new params into (host_state.py)
        self.host_grad: torch.Tensor | None = None
        self.host_out: torch.Tensor | None = None
        #: offloaded keys: views handed out before, see ``views``
        self._views: dict[tuple, tuple[Shard, list[torch.Tensor]]] = {}
        self.grad_buckets: dict[int, torch.Tensor] = {}  # live grad buffers of this iteration
        #: with NCCL user buffers (user_buffers.py) the grad buffers are allocated once, here
        self.persistent_grads = persistent_grads
        self._grad_store: dict[int, torch.Tensor] = {}
        if persistent_grads:
            with comm_allocating():  # what the reduce-scatters read and write
                for b in layout.buckets:
                    self._grad_store[b.index] = torch.empty(
                        b.numel, dtype=grad_sync_dtype, device=device
                    )
                self._grad_shard = torch.empty(shard, dtype=grad_sync_dtype, device=device)

    # -- transient grad buffers ------------------------------------------------------------------

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduce-scattered grads, allocated (uninitialised) on first use: every
        bucket's reduce-scatter writes its chunk before anything reads it."""
        if self._grad_shard is None:
            self._grad_shard = torch.empty(
                self.layout.shard_numel, dtype=self.grad_dtype, device=self.device
            )
        return self._grad_shard

    def release_grad_shard(self) -> None:
        if not self.persistent_grads:
            self._grad_shard = None

    def grad_bucket(self, bucket: int) -> torch.Tensor:
        """The grad buffer of a bucket, allocated (uninitialised) on first use."""
        t = self.grad_buckets.get(bucket)
        if t is None:
            t = self._grad_store.get(bucket)
            if t is None:
                numel = self.layout.buckets[bucket].numel
                t = torch.empty(numel, dtype=self.grad_dtype, device=self.device)
            self.grad_buckets[bucket] = t
        return t

    def release_grad_bucket(self, bucket: int) -> None:
        """Forgets a bucket's grad buffer for this iteration (whoever still holds it keeps it
        alive; a persistent one is reused by the next iteration)."""
        self.grad_buckets.pop(bucket, None)

    # -- views -----------------------------------------------------------------------------------

    def param_view(self, param: int, shape: torch.Size) -> torch.Tensor:
        """The tensor ``param`` is bound to: its range of ``param_space``, as a storage of its
        own (see Note: a param's own storage)."""
        view = _view(self.param_space, self.layout.space_ranges[param]).view(shape)
        return torch.from_dlpack(view)

    def bucket(self, space: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return _view(space, bucket.space_range)

    def chunk(self, space: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of ``bucket`` in a key-space tensor."""
        return _view(self.bucket(space, bucket), bucket.chunk_range(self.rank))

    @staticmethod
    def shard_slice(shard: Shard, r: Range) -> torch.Tensor:
        """Elements ``r`` (shard coordinates, within one bucket's chunk) of a shard."""
        return shard.slice(r) if isinstance(shard, ChunkedShard) else _view(shard, r)

    def views(self, shard: Shard, ranges: list[Range]) -> list[torch.Tensor]:
        """``shard_slice`` of each of ``ranges``; on an offloaded key the same view objects as
        the last time (see Note: views kept for the update thread)."""
        if not (self.offloaded and self._keeps(shard)):
            return [self.shard_slice(shard, r) for r in ranges]
        tag = (id(shard), *ranges)
        kept = self._views.get(tag)
        if kept is None:  # (an entry holds its shard: its id is not another object's)
            # calls planned per step (skipped params) bring ranges of their own
            if len(self._views) >= VIEWS_KEPT + 16 * len(self.layout.buckets):
                self._views.clear()
            kept = self._views[tag] = (shard, [self.shard_slice(shard, r) for r in ranges])
        return list(kept[1])  # the caller's own list

    def _keeps(self, shard: Shard) -> bool:
        """Whether ``shard`` lives as long as this key: its host state, a staging slot."""
        if isinstance(shard, ChunkedShard):
            return shard.kept
        return (
            shard is self.master
            or shard is self.remainder
            or any(shard is t for t in self.state.values())
        )

    def shard_of_bucket(self, shard: Shard, bucket: Bucket) -> torch.Tensor:
        """The part of a shard that holds ``bucket``'s chunk."""
        return self.shard_slice(
            shard, Range(bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel)
        )

    def per_bucket(self, shard: Shard) -> list[torch.Tensor]:
        return [self.shard_of_bucket(shard, b) for b in self.layout.buckets]

    def chunks(self, space: torch.Tensor) -> list[torch.Tensor]:
        return [self.chunk(space, b) for b in self.layout.buckets]

    def fragment(self, shard: Shard, fragment: Fragment) -> torch.Tensor:
        """A fragment's elements of a shard."""
        return self.shard_slice(shard, fragment.shard_range)

    def per_fragment(self, shard: Shard) -> list[torch.Tensor]:
        return [self.fragment(shard, f) for f in self.fragments]

    def fragment_outs(self, space: torch.Tensor) -> list[torch.Tensor]:
        """Key-space views (e.g. of ``sync_space``) of this rank's fragments."""
        return [
            _view(space, f.bucket_range.shift(self.layout.buckets[f.bucket].space_range.start))
            for f in self.fragments
        ]

    def fragment_param_view(self, full: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        """A fragment's elements of a flattened full param."""
        return _view(full.reshape(-1), fragment.param_range)

    def bytes(self, where: str = "device") -> dict[str, int]:
        """Bytes held per persistent buffer on the device (``where="device"``: ``sync_space``
        only when separate, ``master`` 0 when the params are the masters, ``remainder`` and
        ``<state>_scales`` when kept, ``grad_buckets`` and ``grad_shard`` when persistent) or in
        host memory (``where="host"``: what an offloaded key keeps there, ``master`` being the
        host copy of the masters); transient grad buffers are not counted."""

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        if where == "host":
            if not self.offloaded:
                return {}
            # a remainder key's bf16 half stays in the params: staged per bucket, not kept
            out = {"master": size(self.master) if self.master_kind != "remainder" else 0}
            if self.remainder is not None:
                out["remainder"] = size(self.remainder)
            out.update({name: size(t) for name, t in self.state.items()})
            out.update({f"{name}_scales": size(t) for name, t in self.scales.items()})
            return out
        out = {
            "param_space": size(self.param_space),
            "master": size(self.master) if self.master_kind == "copy" else 0,
        }
        if self.offloaded:
            out["master"] = 0
            if self.sync_space is not self.param_space:
                out["sync_space"] = size(self.sync_space)
            if self.persistent_grads:
                out["grad_buckets"] = sum(size(t) for t in self._grad_store.values())
                out["grad_shard"] = size(self.grad_shard)
            return out
        if self.remainder is not None:
            out["remainder"] = size(self.remainder)
        if self.sync_space is not self.param_space:
            out["sync_space"] = size(self.sync_space)
        for name, t in self.state.items():
            out[name] = size(t)
        for name, t in self.scales.items():
            out[f"{name}_scales"] = size(t)
        if self.persistent_grads:
            out["grad_buckets"] = sum(size(t) for t in self._grad_store.values())
            out["grad_shard"] = size(self.grad_shard)
        return out
