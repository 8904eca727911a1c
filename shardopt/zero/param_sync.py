"""Param sync: the all-gather of every bucket back into the params after the update.

The update writes this rank's chunk of each bucket (into the params themselves for fp32 params
gathered in fp32, else into the sync buffer); ``start()`` all-gathers every bucket in forward order
(registration order: buckets reversed). Without overlap it waits at once. With overlap the
all-gathers of a module's params are finished when they are first read (see Note: reads between
step and forward), so the all-gathers of later layers overlap the forward of earlier ones.

With CPU offload the offloaded buckets are updated by the offload worker thread after ``step()``
has handed them over (offload_worker.py): ``defer`` names them, and their all-gathers are started
from this (the main) thread in the worker's order, each once the worker has updated its bucket:
all of them before ``start()`` returns without overlap; with overlap, those up to the bucket a
forward needs in its pre-hook, and the rest in ``flush()`` (before this rank's next collective
of the grad sync) or ``wait()``. Collectives stay in one order on every rank, decided by the
program, never by the worker's timing.

Note: reads between step and forward
    With ``overlap_param_sync=True`` a read of a param after ``step()`` must see the new value
    wherever it happens. A global forward pre-hook finishes, before each module's forward, the
    buckets of that module's own params; a forward also reads params it does not own (a tied
    head, ``F.linear(h, self.head.weight)``; a child called through ``child.forward()``, which
    runs no hook), and a training loop reads them between ``step()`` and the next forward
    (``model.parameters()`` for an EMA or a norm, ``p.data`` writes). So ``start()`` also gives
    every module owning params still in flight a ``_WaitingParams`` as its ``_parameters``: the
    first read through it (``module.weight``, ``parameters()``, ``state_dict()``, ``.to()``)
    finishes that module's buckets and puts the module's own dict back, so later reads cost
    nothing and a ``torch.compile`` graph sees the module as it was. The modules are those in the
    subtrees of the modules that ran a forward before the first step (found at the first step).
    A read on another thread, through a reference to the param kept outside its module (a list
    of params taken before ``step()``, the optimizer's param groups) or of a module added later
    is not seen: ``wait()`` first. With offload, finishing a bucket may start all-gathers still
    with the worker (collectives): reads outside a forward must then happen on every rank, in
    the same order, before any other collective on the group, or after ``wait()`` on every rank.
    An optimizer collected without ``close()`` finishes its last step then
    (``finish_when_dropped``).
"""

from __future__ import annotations

import threading
import weakref

import torch

from shardopt.zero import comm
from shardopt.zero.grad_sync import BucketId
from shardopt.zero.offload import host_state
from shardopt.zero.offload.worker import Progress
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
        #: modules seen running a forward before the first step (their subtrees are searched
        #: for the modules that own params: see Note: reads between step and forward)
        self._watched: list[weakref.ref] = []
        #: (module, its buckets) of every module owning params of this optimizer, once found
        self._owners: list[tuple[weakref.ref, list[BucketId]]] | None = None
        #: id(module) -> its ``_WaitingParams`` installed for the last step's all-gathers
        self._waiting: dict[int, _WaitingParams] = {}
        #: bucket -> ids of the modules whose ``_WaitingParams`` wait for it
        self._bucket_waiters: dict[BucketId, list[int]] = {}
        #: the thread that runs the step (the only one that may issue or wait for collectives)
        self._thread = threading.get_ident()
        #: the optimizer's finalizer that finishes the last step if it is dropped without
        #: ``close()`` (``finish_when_dropped``)
        self._dropped: weakref.finalize | None = None
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
        self._thread = threading.get_ident()
        if not self.busy:
            self.on_published()
        elif not self.overlap or (progress is None and comm.world_size(self.process_group) == 1):
            self.wait()  # one rank and no offload: the params now, nothing to overlap with
        else:
            self._install_forward_wait()
            self._install_waiting_params()

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
        for module_id in self._bucket_waiters.pop(bucket_id, ()):
            waiting = self._waiting.get(module_id)
            if waiting is not None:
                waiting.pending -= 1
                if waiting.pending <= 0:
                    self._release(module_id)
        if not self.busy:
            self.on_published()

    def wait(self) -> None:
        """Finishes every all-gather of the last step (and the offload worker's updates)."""
        try:
            self.flush()
            for bucket_id in list(self.pending):
                self._finish_bucket(bucket_id)
        finally:
            self._remove_forward_hook()
            for module_id in list(self._waiting):
                self._release(module_id)
            self._bucket_waiters.clear()

    def close(self) -> None:
        """Finishes in-flight all-gathers and removes the global hooks (the layout is re-planned
        and another ParamSync takes over)."""
        if self._dropped is not None:
            self._dropped.detach()  # (it would keep this object alive with its owner)
            self._dropped = None
        self.wait()
        if self._watch_hook is not None:
            self._watch_hook.remove()
            self._watch_hook = None

    def finish_when_dropped(self, owner: object) -> None:
        """When ``owner`` (the optimizer) is collected without ``close()``, its last step is
        finished: the all-gathers still with the offload worker are started and every one is
        waited for, so the params hold the last update (see Note: reads between step and
        forward). At ``del`` of the last reference that is the same point on every rank; an
        optimizer kept in a reference cycle is collected when the cycle collector runs, which
        can differ between ranks: ``close()`` it (or ``wait_param_sync()``) before dropping it.
        """
        if self._dropped is not None:
            self._dropped.detach()
        self._dropped = weakref.finalize(owner, self.wait)
        self._dropped.atexit = False  # at exit the process group may be gone first

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
            sync._watched.append(weakref.ref(module))
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

    # -- reads between step and forward (see Note: reads between step and forward) --------------

    def _find_owners(self) -> list[tuple[weakref.ref, list[BucketId]]]:
        """The modules that own params of this optimizer, in the subtrees of the modules that
        ran a forward before the first step (a head never called, a child called through
        ``.forward()``: their parents ran), with the buckets of their own params."""
        owners, visited = [], set()
        stack = [m for r in self._watched if (m := r()) is not None]
        while stack:
            module = stack.pop()
            if id(module) in visited:
                continue
            visited.add(id(module))
            stack.extend(m for m in module._modules.values() if m is not None)
            if any(id(p) in self.sharded.param_index for p in module._parameters.values()):
                buckets = self._buckets_of(module)
                if buckets:
                    owners.append((weakref.ref(module), buckets))
        self._watched = []  # (found once: the modules of the first forward)
        return owners

    def _install_waiting_params(self) -> None:
        """After ``start()`` with overlap: each module owning params whose all-gather is in
        flight or still with the offload worker reads them through a ``_WaitingParams``."""
        if self._owners is None:
            self._owners = self._find_owners()
        busy = set(self.pending) | set(self._deferred_index)
        for ref, buckets in self._owners:
            module = ref()
            mine = [b for b in buckets if b in busy]
            if module is None or not mine or id(module) in self._waiting:
                continue
            params = module.__dict__.get("_parameters")
            if type(params) is not dict:  # (replaced by someone else: left alone)
                continue
            waiting = _WaitingParams(params)
            waiting.bind(self, module, params, len(mine))
            module.__dict__["_parameters"] = waiting
            self._waiting[id(module)] = waiting
            for b in mine:
                self._bucket_waiters.setdefault(b, []).append(id(module))

    def _release(self, module_id: int) -> None:
        """A module's own ``_parameters`` back in place (with any change made meanwhile)."""
        waiting = self._waiting.pop(module_id, None)
        if waiting is not None:
            waiting.restore()

    @torch.compiler.disable  # see Note: torch.compile (shardopt/zero/engine.py)
    def finish_module(self, module: torch.nn.Module) -> None:
        """Finishes the all-gathers of ``module``'s own params (a read through its
        ``_WaitingParams`` on the thread that runs the step; other threads read as they are)."""
        if threading.get_ident() != self._thread:
            return
        for bucket_id in self._buckets_of(module):
            self._finish_bucket(bucket_id)
        self._release(id(module))
        if not self.busy:
            self._remove_forward_hook()


class _WaitingParams(dict):
    """A module's ``_parameters`` while the all-gathers of its params are in flight: the first
    read of a param through it (``module.weight``, ``module.parameters()``, ``state_dict()``)
    finishes them and puts the module's own dict back (see Note: reads between step and
    forward). Pickled and copied as a plain dict."""

    def bind(self, sync: ParamSync, module: torch.nn.Module, original: dict, pending: int) -> None:
        self._sync = weakref.ref(sync)
        self._module = weakref.ref(module)
        self._original = original
        #: buckets of the module's params not finished yet
        self.pending = pending
        self._finishing = False

    def _finish(self) -> None:
        if self._finishing:  # (a read while finishing: the hooks of a bucket's wait)
            return
        sync, module = self._sync(), self._module()
        self._finishing = True
        try:
            if sync is not None and module is not None:
                sync.finish_module(module)
            elif module is not None:
                self.restore()
        finally:
            self._finishing = False

    def restore(self) -> None:
        """The module's own dict back in place, holding what this one holds now."""
        module, original = self._module(), self._original
        if module is None or module.__dict__.get("_parameters") is not self:
            return
        if dict.keys(original) != dict.keys(self) or any(
            original[k] is not v for k, v in dict.items(self)
        ):
            original.clear()
            original.update(dict.items(self))
        module.__dict__["_parameters"] = original

    def __getitem__(self, name):
        self._finish()
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        self._finish()
        return dict.get(self, name, default)

    def items(self):
        self._finish()
        return dict.items(self)

    def values(self):
        self._finish()
        return dict.values(self)

    def __reduce_ex__(self, protocol):  # (a deep copy of the model copies the new values)
        self._finish()
        return dict, (dict(dict.items(self)),)
