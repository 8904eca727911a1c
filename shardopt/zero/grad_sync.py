"""Grad sync: the post-accumulate-grad hooks and the bucketed reduce-scatter of one iteration.

Each trainable param's hook copies its grad into its bucket's transient grad buffer (allocated
when the bucket's first grad arrives; added to under ``no_sync``) and frees ``param.grad``. A
bucket whose params have all arrived is reduce-scattered asynchronously into this rank's grad
shard, strictly in bucket order (so every rank issues collectives in one order even when some
params get no grad on some ranks), and its buffer is released once the reduce-scatter two buckets
later is launched (bounded extra memory, no full-size grad buffer, nothing to zero). What one
iteration knows lives in one ``Iteration`` object, replaced by ``reset()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from shardopt.optimizers.fused_optimizer import check_grad
from shardopt.zero import comm
from shardopt.zero.lockstep import (
    PHASE_BACKWARD,
    PHASE_NORM,
    PHASE_STEP,
    RANK_SLOTS,
    SLOT_NORM,
    Lockstep,
    LockstepError,
    Reduced,
)
from shardopt.zero.sharded_params import Key, ShardedParams

# Reduce-scatters in flight during backward before the oldest is waited on (on the compute
# stream, no host sync on NCCL) and its transient grad bucket released; Apex's pipeline_size.
MAX_GRAD_BUCKETS_IN_FLIGHT = 2

BucketId = tuple[int, int]  # (key index, bucket index)


@dataclass
class Iteration:
    """The grad-sync state of one iteration (from the first backward to ``step()``)."""

    pending: dict[BucketId, int]  # params of each bucket whose grads have not arrived
    order: list[BucketId]  # the one launch order of every rank
    next_launch: int = 0  # first bucket of ``order`` not yet reduce-scattered
    handles: list[comm.Handle] = field(default_factory=list)
    next_wait: int = 0  # first handle not yet waited on
    synced: bool = False  # every bucket reduce-scattered and waited on
    arrived: set[int] = field(default_factory=set)  # params whose synced grad has arrived
    written: set[int] = field(default_factory=set)  # params whose grads are in a live bucket
    touched: set[int] = field(default_factory=set)  # params with a grad in this iteration
    rounds: int = 0  # synchronised backward passes after the first (accumulated, as DDP)
    round_closed: bool = False  # the last synchronised backward launched all its buckets
    end_queued: bool = False  # this backward's end-of-backward callback is queued


class GradSync:
    """Owns the grad hooks and the iteration's bucket state machine (see the module docstring)."""

    def __init__(
        self,
        sharded: ShardedParams,
        *,
        process_group: comm.ProcessGroup | None,
        redundant_process_group: comm.ProcessGroup | None,
        overlap: bool,
        buckets_in_flight: int = MAX_GRAD_BUCKETS_IN_FLIGHT,
    ) -> None:
        self.sharded = sharded
        self.buckets_in_flight = buckets_in_flight
        self.process_group = process_group
        self.redundant_process_group = redundant_process_group
        self.overlap = overlap
        #: False inside ``no_sync()``: grads accumulate in the buckets, nothing is launched
        self.enabled = True
        #: what this rank did since the last step (see Note: lockstep in lockstep.py)
        self.lockstep = Lockstep(sharded.owner)
        #: CPU offload: run before this iteration's grads land or its collectives start (the
        #: last step's all-gathers still with the offload worker start first: ParamSync.flush)
        self.before_sync: Callable[[], None] | None = None
        #: CPU offload: a bucket's reduce-scatter was launched during backward, and
        #: ``zero_grad()`` drops the iteration (offload_backward.py)
        self.on_launch: Callable[[Key, int, comm.Handle], None] | None = None
        self.on_drop: Callable[[], None] | None = None
        self.reset()
        # The hooks hold this object weakly: params outlive the optimizer, and a strong reference
        # would keep every buffer alive after it is dropped. They are removed when this object is
        # collected (not when some wrapper forwarding to the optimizer is).
        ref = weakref.WeakMethod(self._on_grad)

        @torch.compiler.disable  # see Note: torch.compile (shardopt/zero/engine.py)
        def hook(p: torch.Tensor) -> None:
            method = ref()
            if method is not None:
                method(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in sharded.params]
        self._finalizer = weakref.finalize(self, _remove_all, self._handles)

    def remove_hooks(self) -> None:
        """Removes the hooks for good (``close()``); kept here, not on the optimizer, so a
        wrapper sharing the optimizer's attributes (Lightning's) sees it too."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def reset(self) -> None:
        """Starts a new iteration; transient grad buffers go back to the allocator (anything that
        read them was queued on this stream, so reuse is ordered after it)."""
        keys = self.sharded.keys
        self.iteration = Iteration(
            pending={(k.index, b.index): len(b.params) for k in keys for b in k.layout.buckets},
            order=[(k.index, b.index) for k in keys for b in k.layout.buckets],
        )
        for key in keys:
            key.buffers.grad_buckets.clear()
            key.buffers.release_grad_shard()

    @property
    def synced(self) -> bool:
        return self.iteration.synced

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.before_sync is not None:
            self.before_sync()
        sharded, it = self.sharded, self.iteration
        owner = sharded.owner
        i = sharded.param_index[id(p)]
        key = sharded.param_key[i]
        if it.synced:
            raise RuntimeError(
                f"{owner}: param {i} got a gradient after this iteration's grads were synchronised "
                "by step(), grad_norm(), clip_grad_norm() or finish_grad_sync(); call step() (and "
                "zero_grad()) before the next backward"
            )
        check_grad(p, owner)
        if self.enabled and not it.end_queued:  # the first grad of a synchronised backward
            if self.overlap and self.lockstep.launched and self.checks_lockstep:
                self.check_lockstep(PHASE_BACKWARD)
            if it.round_closed:  # a further synchronised backward: accumulate, as DDP does
                self._next_round()
                it = self.iteration
            # at the end of this backward every rank launches what is left of the round,
            # so all ranks issue the same collectives whatever grads each of them got
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            it.end_queued = True
            self.lockstep.passes += 1
        self._add(p, key, i)
        if not self.enabled:
            return
        it.arrived.add(i)
        for b in sharded.param_buckets[i]:
            it.pending[(key.index, b)] -= 1
        if self.overlap:
            self._launch_ready(force=False)

    @torch.compiler.disable  # queued on the autograd engine, as the hook above
    def _end_backward(self) -> None:
        it = self.iteration
        it.end_queued = False
        if it.synced or not self.overlap:
            return
        self._launch_ready(force=True)
        it.round_closed = True

    def _next_round(self) -> None:
        """Starts another round of reduce-scatters, which add into the grad shard."""
        it = self.iteration
        keys = self.sharded.keys
        it.pending = {(k.index, b.index): len(b.params) for k in keys for b in k.layout.buckets}
        it.next_launch = 0
        it.arrived = set()
        it.written = set()
        it.rounds += 1
        it.round_closed = False

    def _add(self, p: torch.Tensor, key: Key, i: int) -> None:
        """Copies (first grad of the round) or adds ``p.grad`` into its buckets; frees it."""
        it, sharded = self.iteration, self.sharded
        buf = key.buffers
        grad = p.grad.reshape(-1)
        first = i not in it.written
        with torch.no_grad():
            for b, in_bucket, in_param in sharded.pieces[i]:
                dst = buf.grad_bucket(b).narrow(0, in_bucket.start, in_bucket.numel)
                src = grad.narrow(0, in_param.start, in_param.numel)
                if first:
                    dst.copy_(src)
                else:
                    dst.add_(src)
        it.written.add(i)
        it.touched.add(i)
        p.grad = None

    def _launch_ready(self, force: bool, in_backward: bool = True) -> None:
        """Launches reduce-scatters strictly in bucket order, up to the first incomplete one."""
        it = self.iteration
        while it.next_launch < len(it.order):
            ki, bi = it.order[it.next_launch]
            if not force and it.pending[(ki, bi)] > 0:
                return
            handle = self._reduce_scatter_bucket(self.sharded.keys[ki], bi)
            it.handles.append(handle)
            it.next_launch += 1
            if in_backward and self.on_launch is not None:
                self.on_launch(self.sharded.keys[ki], bi, handle)
            if not force:
                # bound the transient grad memory; the step waits for the rest
                while it.next_wait < len(it.handles) - self.buckets_in_flight:
                    it.handles[it.next_wait].wait()
                    it.next_wait += 1

    def _reduce_scatter_bucket(self, key: Key, bi: int) -> comm.Handle:
        """Completes a bucket's grads (zeros where no grad arrived) and reduce-scatters it into
        this rank's grad shard; the bucket's buffer lives until the handle is waited on."""
        buf = key.buffers
        bucket = key.layout.buckets[bi]
        fresh = bi not in buf.grad_buckets
        grads = buf.grad_bucket(bi)
        if fresh:  # no grad of this bucket arrived on this rank
            grads.zero_()
        else:
            written = self.iteration.written
            holes = [grads.narrow(0, r.start, r.numel) for r in bucket.gaps]
            for i in bucket.params:
                if i not in written:
                    r = next(r for b, r, _ in self.sharded.pieces[i] if b == bi)
                    holes.append(grads.narrow(0, r.start, r.numel))
            if holes:
                torch._foreach_zero_(holes)
        buf.release_grad_bucket(bi)
        self.lockstep.launched = True
        shard = buf.shard_of_bucket(buf.grad_shard, bucket)
        if not self.iteration.rounds:
            return comm.reduce_scatter(shard, grads, self.process_group)
        partial = torch.empty_like(shard)  # a later round adds to the earlier rounds' sum
        handle = comm.reduce_scatter(partial, grads, self.process_group)
        return comm.Handle(None, after=lambda: (handle.wait(), shard.add_(partial)))

    def finish(self) -> None:
        """Launches the buckets not yet reduce-scattered and waits for all of this iteration's
        reduce-scatters (idempotent). Collective."""
        it = self.iteration
        if it.synced:
            return
        if self.before_sync is not None:
            self.before_sync()
        for p in self.sharded.all_params:
            if p.grad is not None:
                raise RuntimeError(self._stray_grad_message(p))
        if self.lockstep.dropped and self.lockstep.launched and not it.touched:
            # this rank dropped grads whose reduce-scatters it had launched: launching them
            # again would pair with the other ranks' next collective (see Note: lockstep)
            for key in self.sharded.keys:
                key.buffers.grad_shard.zero_()
        else:
            self._launch_ready(force=True, in_backward=False)
        for h in it.handles:
            h.wait()
        it.handles = []
        it.next_wait = 0
        if self.redundant_process_group is not None:
            for key in self.sharded.keys:
                comm.all_reduce(key.buffers.grad_shard, self.redundant_process_group)
        it.synced = True

    def unused_params(self, failed: int | None = None) -> tuple[frozenset[int], int | None]:
        """Params no rank computed a grad for in this iteration (see Note: skipped params in
        update_calls.py), and the param some rank reported as ``failed`` (None if none): one
        all-reduce of a count per param (plus the lockstep slots) and a host sync. Collective."""
        counts = torch.zeros(len(self.sharded.params), dtype=torch.float32)
        if self.iteration.touched:
            counts[list(self.iteration.touched)] = 1.0
        reduced = self._all_reduce_flags(PHASE_STEP, counts, failed)  # see Note: lockstep
        unused = frozenset((reduced.counts == 0).nonzero().flatten().tolist())
        return unused, reduced.failed

    def norm_all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of the grad norm's ``partial`` sums of squares, in the
        step-interval layout and checked for lockstep (see Note: lockstep): a (1,) float32
        device tensor. Collective."""
        counts = torch.zeros(len(self.sharded.params), dtype=torch.float32)
        reduced = self._all_reduce_flags(PHASE_NORM, counts, None, partial)
        return reduced.sumsq.reshape(1).to(partial.device)

    def _all_reduce_flags(
        self,
        phase: int,
        counts: torch.Tensor,
        failed: int | None,
        partial: torch.Tensor | None = None,
    ) -> Reduced:
        """The sum all-reduce of the step-interval layout (param counts, this rank's slots)
        in the shard group, then in the redundant group (where a rank tells its replicas that
        its shard group left lockstep), checked for lockstep: raises ``LockstepError`` on every
        rank if the ranks differ, after both (see Note: lockstep)."""
        n = counts.numel()
        reduced = sumsq = error = None
        chain = [self.process_group]
        if self.redundant_process_group is not None:
            chain.append(self.redundant_process_group)
        for group in chain:
            flags = self.lockstep.flags(phase, counts, failed, group, left=error is not None)
            flags = flags.to(self.sharded.device)
            if partial is not None and reduced is None:  # the norm: this rank's own slot
                at = n + comm.rank(group) * RANK_SLOTS + SLOT_NORM
                flags[at : at + 1].copy_(partial.reshape(1))
            comm.all_reduce(flags, group)
            reduced = self.lockstep.decode(flags.cpu(), n, group)
            counts, failed = reduced.counts, reduced.failed
            sumsq = reduced.sumsq if sumsq is None else sumsq  # the norm: the shard group's
            error = error or reduced.error
        if error is not None:
            raise LockstepError(error)
        reduced.sumsq = sumsq
        return reduced

    @property
    def checks_lockstep(self) -> bool:
        """Whether the step-interval all-reduces carry the lockstep check (see Note:
        lockstep)."""
        return self.sharded.config.skip_unused_params

    def check_lockstep(self, phase: int) -> None:
        """The step-interval all-reduce outside ``step()`` and the norm: where a further
        synchronised backward starts (it pairs with a step() or a grad-norm call on ranks that
        did not skip their step()), and in CPU offload's ``zero_grad()`` after updates during
        backward (offload_backward.py); raises ``LockstepError`` on every rank if they differ."""
        self._all_reduce_flags(phase, torch.zeros(len(self.sharded.params)), None)

    def drop(self) -> None:
        """``zero_grad()``: remembers whether grads already synchronised are dropped."""
        it = self.iteration
        if self.on_drop is not None:
            self.on_drop()
        if it.arrived or it.next_launch or it.rounds:
            self.lockstep.dropped = True

    def _stray_grad_message(self, p: torch.Tensor) -> str:
        owner = self.sharded.owner
        if id(p) not in self.sharded.param_index:
            return (
                f"{owner}: a param that was frozen (requires_grad=False) when the optimizer was "
                "built now has a gradient; changing requires_grad after construction is not "
                "supported: build the optimizer again"
            )
        return (
            f"{owner}: a param has .grad set at step time, so something other than this "
            "optimizer wrote gradients: is the model still wrapped in DistributedDataParallel? "
            "Remove the DDP wrapper (this optimizer syncs gradients itself; use "
            "optimizer.no_sync() instead of model.no_sync())"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = previous


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
