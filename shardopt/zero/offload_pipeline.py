"""CPU offload, the step: the update of offloaded keys bucket by bucket through staging slots.

Note: the offloaded step
    After the reduce-scatters (and the global norm, when clipping, a GradScaler or LAMB needs it)
    the GPU keys are updated as without offload; then each offloaded key is updated bucket by
    bucket, in bucket order (the order backward produced the grads):

      1. the bucket's grad chunk is copied, in its own dtype (bf16 grads: 2 B/param), into a
         staging slot: on CUDA an asynchronous copy on a copy stream into a page-locked slot of
         exact size (plain host memory registered with ``cudaHostRegister``, not torch's
         power-of-two pinned cache); the next bucket's copy is issued before this bucket's
         update runs, so the transfer overlaps the CPU work;
      2. the update rule runs the same kernels on that bucket's part of the host state, on the
         offload thread budget, writing the new params (cast in the kernel) into an out slot;
      3. the out slot is copied into this rank's chunk of the sync space (asynchronously on
         CUDA); the all-gathers wait for these copies. A ``remainder`` key (bf16 params with
         int16 remainders) keeps no host copy of its params: the bucket's bf16 params come down
         into a slot of their own beside the grads, the kernel updates them there with the host
         remainders, and they go back up.

    Update rules whose step has per-step extras outside the kernel calls (SGD's momentum flag,
    LAMB's and NovoGrad's all-reduced per-tensor norms) take the whole shard in one pass
    instead: grads are staged for the whole key first (``host_state.stage_grads``). There are
    ``staging_slots`` slots per direction, each the size of the key's largest bucket chunk; a
    slot is reused only once the copy that last used it has finished. On a CPU job the copies
    are host copies and run in the same order, so the schedule is the one CI tests.
"""

from __future__ import annotations

import contextlib

import torch

from shardopt.zero import host_state
from shardopt.zero.flat_buffer import ChunkedShard
from shardopt.zero.layout import Range


class _Slots:
    """A ring of exact-size host buffers of one dtype (page-locked on CUDA when asked)."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.buffers = [torch.empty(numel, dtype=dtype) for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            for b in self.buffers:  # flags 0: cudaHostRegisterDefault
                if numel:
                    code = cudart.cudaHostRegister(b.data_ptr(), b.numel() * b.element_size(), 0)
                    if int(code) != 0:
                        raise RuntimeError(f"cudaHostRegister failed with error {int(code)}")
            self.pinned = True
        self.next = 0

    def take(self) -> tuple[int, torch.Tensor]:
        """The next slot, once the copy that last used it has finished."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        return i, self.buffers[i]

    def release(self) -> None:
        if self.pinned:
            cudart = torch.cuda.cudart()
            for b in self.buffers:
                if b.numel():
                    cudart.cudaHostUnregister(b.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


class OffloadPipeline:
    """The staging slots and copy streams of one optimizer's offloaded keys."""

    def __init__(self, keys: list, device: torch.device, slots: int, pin: bool) -> None:
        self.cuda = device.type == "cuda"
        pin = pin and self.cuda
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.grad_slots: dict[int, _Slots] = {}
        self.out_slots: dict[int, _Slots] = {}
        self.param_slots: dict[int, _Slots] = {}
        for key in keys:
            buf = key.buffers
            numel = max((b.chunk_numel for b in key.layout.buckets), default=0)
            self.grad_slots[key.index] = _Slots(slots, numel, buf.grad_dtype, pin)
            out_dtype = buf.sync_space.dtype if buf.master_kind == "copy" else None
            if out_dtype is not None and not buf.out_by_copy:
                self.out_slots[key.index] = _Slots(slots, numel, out_dtype, pin)
            if buf.master_kind == "remainder":  # the bf16 half of the masters, down and up
                self.param_slots[key.index] = _Slots(slots, numel, buf.param_space.dtype, pin)

    @classmethod
    def of(cls, optimizer, settings) -> OffloadPipeline | None:
        """The pipeline of a built optimizer with offloaded keys, else None."""
        keys = [k for k in optimizer.keys if k.buffers.offloaded]
        if settings is None or not keys or not optimizer.bucketwise_update:
            return None  # nothing offloaded, or the whole-shard path (no slots)
        return cls(keys, optimizer.device, settings.staging_slots, settings.pin_memory)

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (the staging slots only; the state is never pinned)."""
        return sum(
            sum(b.numel() * b.element_size() for b in r.buffers) for r in self._rings() if r.pinned
        )

    def staging_bytes(self) -> int:
        """Host bytes of every staging slot."""
        return sum(sum(b.numel() * b.element_size() for b in r.buffers) for r in self._rings())

    def _rings(self) -> list[_Slots]:
        return [*self.grad_slots.values(), *self.out_slots.values(), *self.param_slots.values()]

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        if stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _stage(self, key, bucket) -> tuple:
        """The bucket's grad chunk (and a remainder key's bf16 params) into the next slots:
        (grads, params or None, the params' slot, the copy's event)."""
        buf = key.buffers
        ring = self.grad_slots[key.index]
        i, slot = ring.take()
        grads = slot[: bucket.chunk_numel]
        event = self._copy(self.d2h, grads, buf.shard_of_bucket(buf.grad_shard, bucket))
        ring.events[i] = event
        params, j = None, None
        if key.index in self.param_slots:
            ring = self.param_slots[key.index]
            j, slot = ring.take()
            params = slot[: bucket.chunk_numel]
            event = self._copy(self.d2h, params, buf.chunk(buf.param_space, bucket))
            ring.events[j] = event  # reused only after its copy back (set below)
        return grads, params, j, event

    @torch.no_grad()
    def run(self, optimizer, keys: list, scalars, skipped: bool) -> None:
        """Updates the offloaded ``keys`` bucket by bucket (see Note: the offloaded step)."""
        if self.cuda:  # after what the compute stream did to the grads and the sync space
            self.d2h.wait_stream(torch.cuda.current_stream())
            self.h2d.wait_stream(torch.cuda.current_stream())
        work = [(key, b) for key in keys for b in key.layout.buckets]
        staged = self._stage(*work[0]) if work else None
        for n, (key, bucket) in enumerate(work):
            buf = key.buffers
            grads, params, param_slot, event = staged
            ahead = len(self.grad_slots[key.index].buffers) > 1
            if n + 1 < len(work) and ahead:  # the next transfer overlaps this bucket's update
                staged = self._stage(*work[n + 1])
            if event is not None:
                event.synchronize()
            shard = Range(bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel)
            buf.host_grad = ChunkedShard([grads], [shard.start])
            out = None
            if key.index in self.out_slots:
                o, out = self.out_slots[key.index].take()
                out = out[: bucket.chunk_numel]
                buf.host_out = ChunkedShard([out], [shard.start])
            device_master = buf.master
            if params is not None:  # the staged bf16 half of the masters, updated in place
                buf.master = ChunkedShard([params], [shard.start])
            try:
                with optimizer.update_calls.within(key, shard):
                    optimizer._update(scalars)
                    calls = optimizer._calls(key)
            finally:
                source = buf.master if out is None else buf.host_out
                buf.master = device_master
            if not skipped and not buf.out_by_copy:
                event = None
                for call in calls:
                    for shard_r, space_r in zip(call.shard_ranges, call.space_ranges):
                        event = self._copy(
                            self.h2d,
                            buf.sync_space.narrow(0, space_r.start, space_r.numel),
                            buf.shard_slice(source, shard_r),
                        )
                if out is not None:
                    self.out_slots[key.index].events[o] = event
                if params is not None:
                    self.param_slots[key.index].events[param_slot] = event
            host_state.release(buf)
            if n + 1 < len(work) and not ahead:  # one slot: the next copy after the update
                staged = self._stage(*work[n + 1])
        if self.cuda:  # the all-gathers read what the copies wrote
            torch.cuda.current_stream().wait_stream(self.h2d)


def update(optimizer, scalars) -> None:
    """The update of every key of one step: the GPU keys, then the offloaded ones (see Note: the
    offloaded step); nothing moves into the params on a step skipped for inf/nan."""
    offloaded = [k for k in optimizer.keys if k.buffers.offloaded]
    if not offloaded:
        optimizer._update(scalars)
        return
    found_inf = scalars.found_inf_t  # read on the host once per step
    skipped = found_inf is not None and bool(found_inf.item())
    plan = optimizer.offload_plan
    pipeline = optimizer._offload_pipeline
    if optimizer.bucketwise_update:
        with optimizer.update_calls.within(None, None):
            optimizer._update(scalars)  # the GPU keys
        with host_state.threads(plan.threads):
            pipeline.run(optimizer, offloaded, scalars, skipped)
        return
    for key in offloaded:
        host_state.stage_grads(key.buffers)
    with host_state.threads(plan.threads):
        optimizer._update(scalars)
    for key in offloaded:
        host_state.publish(key.buffers, optimizer._calls(key), skipped)
