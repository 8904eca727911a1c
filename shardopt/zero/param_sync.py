"""Param sync: the all-gather of every bucket back into the params after the update.

The update writes this rank's chunk of each bucket (into the params themselves for fp32 params
gathered in fp32, else into the sync buffer); ``start()`` all-gathers every bucket in forward order
(registration order: buckets reversed). Without overlap it waits at once. With overlap a global
forward pre-hook waits, before each module's forward, only for the buckets holding that module's
own params, so the all-gathers of later layers overlap the forward of earlier ones; any other
read of the params needs ``wait()`` first.

With CPU offload the offloaded buckets are updated by the offload worker thread after ``step()``
has handed them over (offload_worker.py): ``defer`` names them, and their all-gathers are started
from this (the main) thread in the worker's order, each once the worker has updated its bucket:
all of them before ``start()`` returns without overlap; with overlap, those up to the bucket a
forward needs in its pre-hook, and the rest in ``flush()`` (before this rank's next collective
of the grad sync) or ``wait()``. Collectives stay in one order on every rank, decided by the
program, never by the worker's timing.
"""

from __future__ import annotations

import weakref

import torch

from shardopt.zero import comm, host_state
from shardopt.zero.grad_sync import BucketId
from shardopt.zero.offload_worker import Progress
from shardopt.zero.sharded_params import ShardedParams
from shardopt.zero.sync_bits import sync_to_params, write_sync


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype.is_floating_point else t.view(torch.uint8)


class ParamSync:
    """Owns the in-flight all-gathers of the last step and the forward pre-hook."""

    def __init__(
        self, sharded: ShardedParams, *, process_group: comm.ProcessGroup | None, overlap: bool
    ) -> None:
        #: called when the last all-gather of a step has landed in the params
        self.on_published = sharded.note_params_published
        self.sharded = sharded
        self.process_group = process_group
        self.overlap = overlap
        self.pending: dict[BucketId, comm.Handle] = {}
        self._forward_hook = None
        self._module_buckets: dict[int, list[BucketId]] = {}
        self._watch_hook = self._watch_modules() if overlap else None
        #: the offload worker's buckets of the next ``start()`` (see ``defer``)
        self._next_progress: Progress | None = None
        #: the offload worker's buckets of the last step, and how many are all-gathering
        self.progress: Progress | None = None
        self._issued = 0
        self._deferred_index: dict[BucketId, int] = {}

    def defer(self, progress: Progress) -> None:
        """The next ``start()`` leaves ``progress.order``'s buckets to the offload worker: their
        all-gathers start once it has updated them."""
        self._next_progress = progress

    @property
    def busy(self) -> bool:
        """Whether an all-gather of the last step is in flight or not started yet."""
        return bool(self.pending) or self.progress is not None

    def start(self) -> None:
        """All-gathers every bucket; waits unless overlapping with the next forward."""
        if self._watch_hook is not None:
            self._watch_hook.remove()
            self._watch_hook = None
        progress, self._next_progress = self._next_progress, None
        deferred = {} if progress is None else {b: n for n, b in enumerate(progress.order)}
        pending: dict[BucketId, comm.Handle] = {}
        for key in self.sharded.keys:
            for bucket in reversed(key.layout.buckets):  # the update wrote this rank's chunk
                if (key.index, bucket.index) not in deferred:
                    pending[(key.index, bucket.index)] = self._all_gather(key, bucket)
        self.pending = pending
        self.progress = progress if deferred else None
        self._issued = 0
        self._deferred_index = deferred
        if not self.busy:
            self.on_published()
        elif not self.overlap or (progress is None and comm.world_size(self.process_group) == 1):
            self.wait()  # one rank and no offload: the params now, nothing to overlap with
        else:
            self._install_forward_wait()

    def _all_gather(self, key, bucket) -> comm.Handle:
        buf = key.buffers
        # integer bits travel as bytes (neither gloo nor NCCL has every integer type)
        return comm.all_gather(
            _bytes_of(buf.bucket(buf.sync_space, bucket)),
            _bytes_of(buf.chunk(buf.sync_space, bucket)),
            self.process_group,
            async_op=True,
        )

    def _start_deferred(self, upto: int) -> None:
        """Starts the all-gathers of the worker's buckets up to number ``upto``, in its order,
        each once the worker has updated it; after the last one, raises what the worker raised
        (every rank's all-gathers are started first, so none hangs)."""
        progress = self.progress
        while progress is not None and self._issued <= upto:
            n = self._issued
            key_index, bucket_index = progress.order[n]  # (the same order on every rank)
            event = progress.wait_bucket(n)
            if event is not None:  # the bucket's copy into the sync space
                torch.cuda.current_stream().wait_event(event)
            key = self.sharded.keys[key_index]
            bucket_id = (key_index, bucket_index)
            self.pending[bucket_id] = self._all_gather(key, key.layout.buckets[bucket_index])
            self._issued = n + 1
        if progress is not None and self._issued == len(progress.order):
            progress.wait_finished()  # nothing of the step is left on the worker
            self.progress = None
            self._deferred_index = {}
            progress.raise_error()

    def flush(self) -> None:
        """Starts every all-gather of the last step not started yet (waiting for the offload
        worker); called before this rank's next collective, so collectives keep one order."""
        if self.progress is not None:
            self._start_deferred(len(self.progress.order) - 1)

    @torch.no_grad()
    def write_sync_space(self, found_inf_t: torch.Tensor | None) -> None:
        """After the update: the masters into the sync space of keys whose kernels cannot write
        it (fp64 params, an integer ``param_sync_dtype``); nothing changes on a skipped step."""
        for key in self.sharded.keys:
            buf = key.buffers
            if not buf.out_by_copy:
                continue
            for bucket, master in zip(key.layout.buckets, buf.per_bucket(buf.master)):
                out = buf.chunk(buf.sync_space, bucket)
                if found_inf_t is None:
                    write_sync(out, master, buf.param_space.dtype)
                else:
                    new = torch.empty_like(out)
                    write_sync(new, master, buf.param_space.dtype)
                    out.copy_(torch.where(found_inf_t.bool(), out, new))

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Writes the master shards into the params and all-gathers them (blocking)."""
        for key in self.sharded.keys:
            buf = key.buffers
            if buf.offloaded and buf.master_kind != "copy":
                host_state.push_params(buf)  # the host copy of the masters into the params
            if buf.master_kind != "copy":
                continue  # the all-gather reads the params' chunks, which are the masters
            for master, out in zip(buf.per_fragment(buf.master), buf.fragment_outs(buf.sync_space)):
                write_sync(out, master, buf.param_space.dtype)
        self.start()
        self.wait()

    def _finish_bucket(self, bucket_id: BucketId) -> None:
        n = self._deferred_index.get(bucket_id)
        if n is not None and n >= self._issued:  # still with the offload worker
            self._start_deferred(n)
        handle = self.pending.pop(bucket_id, None)
        if handle is None:
            return
        handle.wait()
        key = self.sharded.keys[bucket_id[0]]
        buf = key.buffers
        if buf.sync_space is not buf.param_space:
            bucket = key.layout.buckets[bucket_id[1]]
            sync_to_params(buf.bucket(buf.param_space, bucket), buf.bucket(buf.sync_space, bucket))
        if not self.busy:
            self.on_published()

    def wait(self) -> None:
        """Finishes every all-gather of the last step (and the offload worker's updates)."""
        self.flush()
        for bucket_id in list(self.pending):
            self._finish_bucket(bucket_id)
        self._remove_forward_hook()

    def close(self) -> None:
        """Finishes in-flight all-gathers and removes the global hooks (the layout is re-planned
        and another ParamSync takes over)."""
        self.wait()
        if self._watch_hook is not None:
            self._watch_hook.remove()
            self._watch_hook = None

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _buckets_of(self, module: torch.nn.Module) -> list[BucketId]:
        """The buckets holding a module's own params (cached per module); all of its params for
        a ``torch.compile(module)`` wrapper, whose graph runs no hooks of the modules inside (see
        Note: torch.compile in engine.py)."""
        found = self._module_buckets.get(id(module))
        if found is None:
            sharded = self.sharded
            found = []
            compiled = isinstance(getattr(module, "_orig_mod", None), torch.nn.Module)
            for p in module.parameters(recurse=compiled):
                i = sharded.param_index.get(id(p))
                if i is not None:
                    ki = sharded.param_key[i].index
                    found += [(ki, b) for b in sharded.param_buckets[i] if (ki, b) not in found]
            self._module_buckets[id(module)] = found
        return found

    def _watch_modules(self):
        """Until the first step, notes every module that runs a forward with params of this
        optimizer and gives it a state-dict pre-hook that waits for its buckets, so
        ``model.state_dict()`` sees the new values with overlap too."""
        ref = weakref.ref(self)

        @torch.compiler.disable  # see Note: torch.compile (shardopt/zero/engine.py)
        def wait_in_state_dict(module, prefix, keep_vars):
            sync = ref()
            if sync is not None:
                for bucket_id in sync._buckets_of(module):
                    sync._finish_bucket(bucket_id)

        seen: set[int] = set()

        @torch.compiler.disable
        def watch(module, args):
            sync = ref()
            if sync is None or id(module) in seen:
                return
            seen.add(id(module))
            if sync._buckets_of(module):
                module.register_state_dict_pre_hook(wait_in_state_dict)

        return torch.nn.modules.module.register_module_forward_pre_hook(watch)

    def _install_forward_wait(self) -> None:
        if self._forward_hook is not None:
            return
        ref = weakref.ref(self)

        @torch.compiler.disable
        def wait_before_forward(module, args):
            sync = ref()
            if sync is None:
                return
            for bucket_id in sync._buckets_of(module):
                sync._finish_bucket(bucket_id)
            if not sync.busy:
                sync._remove_forward_hook()

        self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
            wait_before_forward
        )
