"""CPU offload, the step: the update of offloaded keys bucket by bucket through staging slots.

Note: the offloaded step
    After the reduce-scatters (and the global norm, when clipping, a GradScaler or LAMB needs it)
    the GPU keys are updated as without offload; then ``step()`` hands the offloaded keys to
    the offload worker thread (offload_worker.py), which updates them bucket by bucket in
    forward order (key by key, each key's buckets reversed: the order param_sync.py gathers
    them, so the bucket the next forward needs first goes first), on the offload thread budget:

      1. the bucket's grad chunk (of the grad shard as ``step()`` left it: the worker holds its
         own reference) is copied, in its own dtype (bf16 grads: 2 B/param), into a staging
         slot (offload_slots.py): on CUDA an asynchronous copy on a copy stream (ordered after
         the compute stream's work at ``step()``) into a page-locked slot of exact size; the
         bucket is handed to the update thread (see Note: the update thread in
         offload_worker.py), and the next bucket's copy is issued and that bucket handed over
         while this one's update runs, so transfers and bookkeeping overlap the CPU work;
      2. on the update thread, the update rule runs the same kernels on that bucket's part of
         the host state, on the offload thread budget, writing the new params (cast in the
         kernel) into an out slot;
      3. the worker copies the out slot into this rank's chunk of the sync space (asynchronously
         on CUDA, then a CUDA event) and reports the bucket done (``Progress``), and the
         main thread starts its all-gather, which waits for that event only (param_sync.py:
         at once without ``overlap_param_sync``, else when a forward needs the bucket or
         before the next grad sync). A ``remainder`` key (bf16 params with
         int16 remainders) keeps no host copy of its params: the bucket's bf16 params come down
         into a slot of their own beside the grads, the kernel updates them there with the host
         remainders, and they go back up. A ``param`` key's params (fp32 params, their own
         masters without offload) come down the same way and the host copy of its masters
         takes them before the update, so a write into the params since the last step (also
         through ``p.data``, which no version counter sees) holds as without offload (Note:
         the params are the truth in engine.py; 4 B/param more down per step).

    Buckets may also be handed over during backward, as soon as their reduce-scatter is
    launched (see Note: updates during backward in offload_backward.py); ``step()`` then hands
    over only the rest, as another job of the same ``Progress``.

Note: the worker's order during backward
    Backward hands buckets over in backward order, and the next forward needs them in the other
    order: run one by one as they came, the bucket the forward needs first would be updated last
    and the forward would wait for the whole update. So buckets handed over during backward are
    queued (``submit_early``) and one job drains the queue: before each bucket's update it merges
    the buckets queued meanwhile into the rest (``refill``) and orders the rest: the buckets whose
    reduce-scatter is done, the one the forward needs first first, then those still reducing, in
    the order they came (the order they finish in); the next bucket's grads are staged during
    the current one's update, and a bucket's reduce-scatter wait goes on the copy stream when its
    own copy is issued, so a copy waits for its own reduce-scatter only. Likewise the compute
    stream: a bucket's copies down and up wait for an event recorded on it when the bucket was
    handed over (its grads done, its params' last reads by backward issued), not for the stream
    as it stood at the latest hand-over. The host runs ahead of the GPU in backward, so when each
    hand-over made both copy streams wait for the compute stream, a copy issued early in the
    host's backward waited for the GPU to reach a much later bucket, and the out slots' copies up
    (which a slot's reuse waits for) for about the end of backward. On one H200
    (launch_scripts/probe/trace_offload.py, clip off, eighth session, two hosts) the worker updated
    5 of the 51 buckets during backward before and 11 after, its grad-copy waits 50.9 -> 6.0 ms an
    iteration; earlier fixes of the same kind: a bucket taken in a job of its own had its copy
    waited on unoverlapped (1.6-1.9 ms each), and every queued bucket's reduce-scatter wait went
    on the copy stream at once (7-18 ms waits, seventh session). When backward ends the rest go in
    forward order, so the forward starts after the first of them. The order does not change a
    bit: each bucket's update reads and writes only its own part of the state. The worker reads a
    ``frozen_view`` of the optimizer: the param groups and skipped-step
    counts as ``step()`` left them, so a scheduler stepped on the main thread meanwhile changes
    only the next step. Keys whose sync space is written from the masters (``out_by_copy``)
    make ``step()`` wait for the worker before ``write_sync_space``.

    Per-step values an update rule writes once per step (SGD's momentum flags,
    ``per_step_attributes``) are the view's own copies, reset before each bucket. Update rules
    with all-reduced per-tensor norms (LAMB, NovoGrad) take the whole shard in one pass on the
    main thread instead: grads are staged for the whole key first
    (``host_state.stage_grads``). There are
    ``staging_slots`` slots per direction, each the size of the key's largest bucket chunk; a
    slot is reused only once the copy and the update that last used it have finished (with one
    slot, a bucket is handed over only after the previous one is done). On a CPU job the copies
    are host copies and run in the same order, so the schedule is the one CI tests.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

import torch

from shardopt.zero.layout import Range
from shardopt.zero.offload import host_state
from shardopt.zero.offload.backward import EarlyUpdates
from shardopt.zero.offload.slots import Slots
from shardopt.zero.offload.worker import (
    OffloadWorker,
    Progress,
    forward_order,
    frozen_view,
    restart,
)


class OffloadPipeline:
    """The staging slots and copy streams of one optimizer's offloaded keys."""

    def __init__(
        self,
        keys: list,
        device: torch.device,
        slots: int,
        pin: bool,
        overlap_backward=False,
        huge_pages: bool = False,
        switch_interval: float | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.cuda = device.type == "cuda"
        pin = pin and self.cuda
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.grad_slots: dict[int, Slots] = {}
        self.out_slots: dict[int, Slots] = {}
        self.param_slots: dict[int, Slots] = {}
        #: buckets handed to the update thread and not yet finished, before the next is handed:
        #: one queued behind the one updating, fewer than a ring has slots (see Note: the
        #: update thread in offload_worker.py)
        self.ahead = min(1, slots - 1)
        for key in keys:
            buf = key.buffers
            numel = max((b.chunk_numel for b in key.layout.buckets), default=0)

            def ring(dtype: torch.dtype, numel: int = numel) -> Slots:
                return Slots(slots, numel, dtype, pin, huge_pages)

            self.grad_slots[key.index] = ring(buf.grad_dtype)
            out_dtype = buf.sync_space.dtype if buf.master_kind == "copy" else None
            if out_dtype is not None and not buf.out_by_copy:
                self.out_slots[key.index] = ring(out_dtype)
            if buf.master_kind in ("remainder", "param"):  # (see ``_update``)
                self.param_slots[key.index] = ring(buf.param_space.dtype)
        #: the thread that runs the offloaded updates (started by the first step)
        self.worker = OffloadWorker(device, switch_interval, cpus)
        #: the updates that start during backward (offload_backward.py)
        self.early = EarlyUpdates(overlap_backward)
        #: buckets handed over during backward not yet taken by the worker, by step (the
        #: ``Progress``), and the steps with a job draining them queued or running (see Note:
        #: the worker's order during backward)
        self._pending: dict[Progress, list[tuple]] = {}
        self._draining: set[Progress] = set()
        self._pending_lock = threading.Lock()

    @classmethod
    def of(cls, optimizer, settings) -> OffloadPipeline | None:
        """The pipeline of a built optimizer with offloaded keys, else None."""
        keys = [k for k in optimizer.keys if k.buffers.offloaded]
        if settings is None or not keys or not optimizer.bucketwise_update:
            return None  # nothing offloaded, or the whole-shard path (no slots)
        pipeline = cls(
            keys,
            optimizer.device,
            settings.staging_slots,
            settings.pin_memory,
            settings.overlap_backward if optimizer.redundant_process_group is None else False,
            settings.huge_pages,
            settings.switch_interval,
            placement.cpus if (placement := optimizer._offload_placement) is not None else None,
        )  # fmt: skip (HSDP: the grads take one more all-reduce after the reduce-scatters)
        # the last step's all-gathers still with the worker start before the next grad sync
        optimizer.grad_sync.before_sync = optimizer.param_sync.flush
        pipeline.early.attach(optimizer)
        return pipeline

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (the staging slots only; the state is never pinned)."""
        return sum(r.nbytes() for r in self._rings() if r.pinned)

    def staging_bytes(self) -> int:
        """Host bytes of every staging slot."""
        return sum(r.nbytes() for r in self._rings())

    def _rings(self) -> list[Slots]:
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

    def _stage(self, key, bucket, shards: dict, wait=None, after=None) -> tuple:
        """The bucket's grad chunk (from ``shards``, the grad shards by key) and a remainder
        or param key's params into the next slots: (the grads' slot and the params' slot or None, as
        chunks of the shard; the params' slot index; the copy's event); ``wait``: the bucket's
        reduce-scatter wait, run first (with the copy stream current on CUDA, so that only this
        bucket's copy waits for it); ``after``: a CUDA event the copy waits for (the compute
        stream's work on the bucket)."""
        if wait is not None:
            with torch.cuda.stream(self.d2h) if self.cuda else contextlib.nullcontext():
                wait()
        if after is not None:
            self.d2h.wait_event(after)
        buf = key.buffers
        ring = self.grad_slots[key.index]
        i, slot = ring.take()
        event = self._copy(
            self.d2h, slot[: bucket.chunk_numel], buf.shard_of_bucket(shards[key.index], bucket)
        )
        ring.events[i] = event
        grads = ring.shard(i, bucket.shard_offset, bucket.chunk_numel)
        params, j = None, None
        if key.index in self.param_slots:
            ring = self.param_slots[key.index]
            j, slot = ring.take()
            event = self._copy(
                self.d2h, slot[: bucket.chunk_numel], buf.chunk(buf.param_space, bucket)
            )
            ring.events[j] = event  # reused only after its copy back (set below)
            params = ring.shard(j, bucket.shard_offset, bucket.chunk_numel)
        return grads, params, j, event

    def submit(
        self, optimizer, work: list, scalars, skipped: bool, progress: Progress, *, view=None,
        ready=None,
    ) -> None:  # fmt: skip
        """Hands the update of the offloaded buckets ``work`` ((key, bucket) pairs, in the order
        to run them) to the worker thread as a job of ``progress`` (see Note: the offloaded
        step); ``view``: the optimizer as the job sees it (``frozen_view``); ``ready``: called
        on the worker first (with the copy stream current on CUDA), e.g. a reduce-scatter's
        wait."""
        # the grad shards as they are now: the main thread drops its own references when the
        # iteration ends (a CUDA block freed then is reused only after the copy stream's reads)
        grads = {key.index: key.buffers.grad_shard for key, _ in work}
        if self.cuda:  # after what the compute stream did to the grads and the sync space
            self.d2h.wait_stream(torch.cuda.current_stream())
            self.h2d.wait_stream(torch.cuda.current_stream())
            for g in grads.values():
                g.record_stream(self.d2h)
        view = frozen_view(optimizer) if view is None else view
        threads = optimizer.offload_plan.threads

        def job() -> None:
            with torch.no_grad(), host_state.threads(threads):
                if ready is not None:
                    with torch.cuda.stream(self.d2h) if self.cuda else contextlib.nullcontext():
                        ready()
                self._run(view, work, grads, scalars, skipped, progress)

        self.worker.submit(job, progress)

    def submit_early(
        self, optimizer, key, bucket, scalars, progress: Progress, view, ready, done=None
    ):  # fmt: skip
        """A bucket handed over during backward (see Note: the worker's order during backward):
        queued for the job that drains them, which is submitted unless one is queued or running.
        ``ready``: the bucket's reduce-scatter wait (with the copy stream current), or None;
        ``done``: whether that reduce-scatter has finished (a query; None: it has)."""
        after = None
        if self.cuda:  # the compute stream's work on this bucket so far (Note: ... backward)
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
            key.buffers.grad_shard.record_stream(self.d2h)
        entry = (key, bucket, key.buffers.grad_shard, ready, done, after)
        with self._pending_lock:
            self._pending.setdefault(progress, []).append(entry)
            if progress in self._draining:
                return
            self._draining.add(progress)
        threads = optimizer.offload_plan.threads

        def job() -> None:
            with torch.no_grad(), host_state.threads(threads):
                self._drain(view, scalars, progress)

        self.worker.submit(job, progress)

    def _take_pending(self, progress: Progress) -> list[tuple]:
        """The early buckets of ``progress``'s step queued so far, in the order they came; when
        none, ends the draining job (under the lock, so a bucket queued later gets a new job)."""
        with self._pending_lock:
            entries = self._pending.pop(progress, [])
            if not entries:
                self._draining.discard(progress)
            return entries

    def _drain(self, view, scalars, progress: Progress) -> None:
        """The worker: updates the early buckets queued so far; before each bucket's update the
        buckets queued meanwhile join the rest (``refill``), and the rest is ordered: those whose
        reduce-scatter is done first, the one the next forward needs first first, then the others
        in the order they came (see Note: the worker's order during backward)."""
        position = {b: n for n, b in enumerate(progress.order)}
        grads: dict = {}
        waits: dict[tuple[int, int], object] = {}  # the reduce-scatter waits not yet staged
        afters: dict[tuple[int, int], torch.cuda.Event] = {}  # per bucket: its ``after`` event
        came: list = []  # per bucket taken, in arrival order: its ``done`` query (or None)
        arrival: dict[tuple[int, int], int] = {}
        finished = 0  # the first ``finished`` of ``came`` have their reduce-scatter done

        def take(entries: list[tuple]) -> list[tuple]:
            for key, bucket, grad_shard, ready, done, after in entries:
                tag = (key.index, bucket.index)
                grads[key.index] = grad_shard
                arrival[tag] = len(came)
                came.append(done)
                if ready is not None:
                    waits[tag] = ready
                if after is not None:
                    afters[tag] = after
            return [(key, bucket) for key, bucket, *_ in entries]

        def order(work: list[tuple]) -> list[tuple]:
            nonlocal finished
            # the reduce-scatters finish about in the order they were issued: stop at the first
            # one not done (a later one done meanwhile waits for the next look)
            while finished < len(came) and (came[finished] is None or came[finished]()):
                finished += 1

            def rank(kb: tuple) -> tuple[int, int]:
                tag = (kb[0].index, kb[1].index)
                n = arrival[tag]
                return (0, position[tag]) if n < finished else (1, n)

            return sorted(work, key=rank)

        def refill(rest: list[tuple]) -> list[tuple]:
            with self._pending_lock:
                entries = self._pending.pop(progress, [])
            return order(rest + take(entries) if entries else rest)

        try:
            while entries := self._take_pending(progress):
                work = order(take(entries))
                self._run(view, work, grads, scalars, False, progress, refill, waits, afters)
        except BaseException:
            with self._pending_lock:  # the job's error ends the step; nothing is left queued
                self._pending.pop(progress, None)
                self._draining.discard(progress)
            for wait in waits.values():  # no reduce-scatter is left unwaited
                with contextlib.suppress(Exception):
                    wait()
            raise

    def _run(
        self, optimizer, work: list, grads: dict, scalars, skipped: bool, progress,
        refill=None, waits: dict | None = None, afters: dict | None = None,
    ) -> None:  # fmt: skip
        """The worker thread: each bucket's update, in ``work``'s order (see Note: the update
        thread); ``refill`` (``_drain``): called with the buckets still to update before each
        hand-over and after the last, returns them ordered, with the ones queued meanwhile
        merged in; ``waits``: reduce-scatter waits by bucket id, each run when its bucket is
        staged; ``afters``: CUDA events by bucket id that its copies down and up wait for (see
        Note: the worker's order during backward)."""
        work = list(work)
        waits = {} if waits is None else waits
        afters = {} if afters is None else afters
        handed: collections.deque = collections.deque()
        try:
            while True:
                if refill is not None:
                    work = refill(work)
                if handed and (len(handed) > self.ahead or not work):
                    self._finish(*handed.popleft(), skipped, progress, afters)
                    continue  # the order may have changed while the worker waited
                if not work:
                    return
                key, bucket = work.pop(0)
                tag = (key.index, bucket.index)
                staged = self._stage(key, bucket, grads, waits.pop(tag, None), afters.get(tag))
                handed.append(self._hand(optimizer, key, bucket, staged, scalars))
        except BaseException:
            for entry in handed:  # no update is left running on the slots
                with contextlib.suppress(BaseException):
                    entry[-1].wait()
            raise

    def _hand(self, optimizer, key, bucket, staged: tuple, scalars) -> tuple:
        """The worker: hands the update of ``bucket`` (its grads ``staged``) to the update
        thread with an out slot; (key, bucket, out slot index, params' slot index, ticket)."""
        grads, params, param_slot, event = staged
        o, out = None, None
        if key.index in self.out_slots:
            ring = self.out_slots[key.index]
            o, _ = ring.take()
            out = ring.shard(o, bucket.shard_offset, bucket.chunk_numel)
        threads = optimizer.offload_plan.threads

        def update() -> tuple:
            with torch.no_grad(), host_state.threads(threads):
                return self._update(optimizer, key, bucket, grads, params, out, event, scalars)

        return key, bucket, o, param_slot, self.worker.hand(update)

    @staticmethod
    def _update(optimizer, key, bucket, grads, params, out, event, scalars) -> tuple:
        """The update thread: one bucket's update (once its grads are in their slot) on the
        host state, its new params into ``out`` (or ``params``, a remainder key's staged bf16
        half, updated in place; all three slots as chunks of the shard: ``Slots.shard``); (the
        kernel calls, the shard the new params are in)."""
        if event is not None and not event.query():  # a query keeps the GIL, a wait does not
            event.synchronize()
        buf = key.buffers
        shard = Range(bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel)
        buf.host_grad = grads
        if out is not None:
            buf.host_out = out
        device_master = buf.master
        if params is not None and buf.master_kind == "param":
            # the host master takes the params' chunk: a write through ``p.data`` since the
            # last step holds, as where the params are the masters (Note: the params are the
            # truth, engine.py)
            buf.views(buf.master, [shard])[0].copy_(buf.views(params, [shard])[0])
        elif params is not None:  # the staged bf16 half of the masters, updated in place
            buf.master = params
        try:
            restart(optimizer)
            with optimizer.update_calls.within(key, shard):
                optimizer._update(scalars)
                calls = optimizer._calls(key)
        finally:
            source = buf.master if out is None else buf.host_out
            buf.master = device_master
            host_state.release(buf)
        return calls, source

    def _finish(self, key, bucket, o, param_slot, ticket, skipped, progress, afters) -> None:
        """The worker: once the bucket's update has run, its new params go up into the sync
        space and the bucket is reported done (its all-gather may start)."""
        calls, source = ticket.wait()
        buf = key.buffers
        event = None
        after = afters.pop((key.index, bucket.index), None)
        if after is not None:  # the params' last reads by backward before they are written
            self.h2d.wait_event(after)
        if not skipped and not buf.out_by_copy:
            for call in calls:
                for shard_r, space_r in zip(call.shard_ranges, call.space_ranges):
                    event = self._copy(
                        self.h2d,
                        buf.sync_space.narrow(0, space_r.start, space_r.numel),
                        buf.shard_slice(source, shard_r),
                    )
            if o is not None:
                self.out_slots[key.index].events[o] = event
            if param_slot is not None:
                self.param_slots[key.index].events[param_slot] = event
        progress.publish((key.index, bucket.index), event)


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
        early = pipeline.early
        progress, done = early.at_step()  # (misuse was raised by ``check_early``)
        view = frozen_view(optimizer)  # before the GPU keys' update writes the per-step values
        with optimizer.update_calls.within(None, None):
            optimizer._update(scalars)  # the GPU keys
        work = forward_order(offloaded)
        progress = Progress([(k.index, b.index) for k, b in work]) if progress is None else progress
        rest = [(k, b) for k, b in work if (k.index, b.index) not in done]
        if rest:  # the step's scalars on the host once, not once per kernel call
            host = dataclasses.replace(
                scalars,
                grad_scale_t=host_state.to_host(scalars.grad_scale_t),
                found_inf_t=host_state.to_host(scalars.found_inf_t),
            )
            pipeline.submit(optimizer, rest, host, skipped, progress, view=view)
        progress.seal()
        optimizer.param_sync.defer(progress)
        if any(k.buffers.out_by_copy for k in offloaded):
            progress.wait_finished()  # write_sync_space reads their host masters next
            progress.raise_error()
        return
    for key in offloaded:
        host_state.stage_grads(key.buffers)
    with host_state.threads(plan.threads):
        optimizer._update(scalars)
    for key in offloaded:
        written = [(c.shard_ranges, c.space_ranges) for c in optimizer._calls(key)]
        host_state.publish(key.buffers, written, skipped)


def close(optimizer) -> None:
    """``close()``: finishes the last step (its worker updates and all-gathers) and stops the
    worker thread."""
    optimizer.wait_param_sync()
    pipeline = optimizer._offload_pipeline
    if pipeline is not None:
        pipeline.worker.stop()
