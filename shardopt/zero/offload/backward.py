"""CPU offload during backward: offloaded bucket updates that start before ``step()``.

Note: updates during backward
    With ``CPUOffload(overlap_backward=...)`` on, an offloaded bucket whose reduce-scatter is
    launched during backward (``overlap_grad_sync``; also at the end of backward) and all of
    whose params got a grad on this rank in this backward is handed to the offload worker at
    once: the worker waits for the reduce-scatter, then updates the bucket as ``step()`` would
    (offload_pipeline.py), with ``step()``'s scalars known in advance: the grad scale is the
    averaging factor alone, no found_inf, each group's step count plus one, and no param of the
    bucket skipped (a param used on this rank is used). The other buckets wait for ``step()``.
    The all-gathers still start in forward order (param_sync.py), whatever order the worker
    updated the buckets in.

    This is exact only when the iteration does not clip, uses no GradScaler and has one
    synchronised backward per step: ``"auto"`` turns it on from the second step when the
    previous step had none of those; ``True`` from the first step. When an iteration with it on
    then clips, passes a GradScaler or ran a second synchronised backward, and some rank updated
    a bucket during backward (one small all-reduce decides, on the rare path only), ``step()``
    raises on every rank before any step count moves (the conditions do not depend on the rank,
    the lockstep check compares them: lockstep.py). The early updates cannot be undone: before
    raising, every rank waits for them and all-gathers every bucket, so the ranks' params agree
    and equal the masters (the early buckets keep this iteration's update, the others not), and
    the iteration ends (its grads are dropped): ``zero_grad()`` and the next iteration work, and
    a checkpoint loaded then resumes exactly. ``zero_grad()`` dropping such an iteration's grads
    does the same, after the lockstep all-reduce of phase "drop" (a rank alone there meets the
    others' ``step()`` or norm: ``LockstepError`` on every rank), and warns instead of raising
    (a loop that skips a batch after backward goes on). The hyperparameters (lr, ...) are read
    when a bucket's update starts: a scheduler stepped before backward is seen, a change between
    backward and ``step()`` is not (for the early buckets). HSDP keeps it off (the grads take
    one more all-reduce after the reduce-scatters).

Note: state I/O between backward and step
    The state after the early updates is part of a step that has not happened: the early
    buckets hold this iteration's update (their masters and state, and this rank's chunk of
    their params), the step count does not. A read there would save that mix; a load could not
    put back the params of those chunks (an optimizer state dict does not carry the fp32
    params that are their own masters, and the params are the truth: Note: the params are the
    truth in engine.py), so ``step()`` would apply the iteration's grads to them twice. Keeping
    pre-images of what an early update writes would double the offloaded host state (or add a
    copy of the param chunks per bucket to the pipeline), for a call that is rare there. So
    every collective state I/O call (``state_dict()``, ``load_state_dict()``,
    ``sharded_state_dict()``, ``load_sharded_state_dict()``, ``shardopt.checkpoint.save`` and
    ``load``) decides at its arrival (``before_state_io``, one small all-reduce, only with
    ``overlap_backward`` on): when any rank updated a bucket during this iteration's backward,
    it raises on every rank and changes nothing; ``step()`` then goes on as if it had not been
    called. Save after ``step()``; to roll back there, ``zero_grad()`` (which keeps the early
    updates, see above) and load a checkpoint with the model's weights.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Literal

import torch

from shardopt.zero import comm
from shardopt.zero.amp import StepScalars
from shardopt.zero.lockstep import PHASE_DROP
from shardopt.zero.offload.worker import Progress, forward_order, frozen_view

_HOW = (
    "an update that starts during backward cannot know it; pass "
    "offload=shardopt.CPUOffload(overlap_backward=False)"
)


class EarlyUpdates:
    """The updates during backward of one optimizer (see Note: updates during backward)."""

    def __init__(self, mode: bool | Literal["auto"]) -> None:
        self.mode = mode
        #: the last step had no clipping, GradScaler or second synchronised backward
        self.clean_before = False
        self.reset()

    def reset(self) -> None:
        self.progress: Progress | None = None
        self.done: set[tuple[int, int]] = set()
        self._view = None
        self._scalars: StepScalars | None = None
        self._iteration = None  # the grad-sync iteration the updates belong to

    @property
    def on(self) -> bool:
        """Whether this iteration's buckets may be updated during backward."""
        return self.mode is True or (self.mode == "auto" and self.clean_before)

    def attach(self, optimizer) -> None:
        """Hooks into the optimizer's grad sync (held weakly: the hooks outlive nothing)."""
        if self.mode is False:
            return
        ref = weakref.ref(optimizer)

        def launched(key, bucket_index: int, handle) -> None:
            opt = ref()
            if opt is not None:
                self.launched(opt, key, bucket_index, handle)

        def dropped() -> None:
            opt = ref()
            if opt is not None:
                self.dropped(opt)

        optimizer.grad_sync.on_launch = launched
        optimizer.grad_sync.on_drop = dropped

    def launched(self, optimizer, key, bucket_index: int, handle) -> None:
        """A bucket's reduce-scatter was launched during backward: its update starts now when
        every param of it got a grad on this rank."""
        buf = key.buffers
        it = optimizer.grad_sync.iteration
        if not self.on or not buf.offloaded or it.rounds:
            return
        bucket = key.layout.buckets[bucket_index]
        if any(i not in it.arrived for i in bucket.params):
            return  # some param has no grad here yet: step() updates the bucket
        if self.progress is not None and self._iteration is not it:
            self._abandon()  # an iteration that ended without step() (it raised)
        if self.progress is None:
            self._iteration = it
            offloaded = [k for k in optimizer.keys if k.buffers.offloaded]
            self.progress = Progress([(k.index, b.index) for k, b in forward_order(offloaded)])
            self._view = frozen_view(optimizer, steps_ahead=1, unused=frozenset())
            factor = torch.full((1,), optimizer.amp.grad_factor, dtype=torch.float32)
            self._scalars = StepScalars(factor, None, None)  # step()'s, on the host
        self.done.add((key.index, bucket_index))
        work = getattr(handle, "_work", None)  # the reduce-scatter the worker waits for
        optimizer._offload_pipeline.submit_early(
            optimizer, key, bucket, self._scalars, self.progress, self._view,
            None if work is None else work.wait, None if work is None else work.is_completed,
        )  # fmt: skip

    def _abandon(self) -> None:
        """Waits for the updates already handed to the worker (raising nothing of theirs: the
        caller raises) and forgets them."""
        progress = self.progress
        self.reset()
        if progress is not None:
            progress.seal()
            progress.wait_finished()

    def _updated(self, optimizer) -> int:
        """Buckets updated during this iteration's backward, summed over the ranks (one small
        all-reduce: every rank must call it)."""
        n = torch.tensor([float(len(self.done))], device=optimizer.device)
        comm.all_reduce(n, optimizer.process_group)
        return int(n.item())

    def _keep(self, optimizer) -> None:
        """The early updates stay (they cannot be undone): waits for them, then all-gathers
        every bucket (collective), so every rank's params hold the masters; the caller ends
        the iteration."""
        self._abandon()
        optimizer.param_sync.publish_masters()

    def check(self, optimizer, scalars: StepScalars) -> None:
        """``step()``, before any step count moves: raises on every rank when this iteration
        made the updates during backward inexact, after making the ranks' params agree and
        ending the iteration (see Note: updates during backward)."""
        clipped = optimizer.amp.max_norm is not None
        scaled = scalars.found_inf_t is not None
        rounds = optimizer.grad_sync.iteration.rounds
        active = self.on
        self.clean_before = not (clipped or scaled or rounds)
        if not active or self.clean_before or not self._updated(optimizer):
            return  # (no rank updated a bucket early: the step is exact)
        self._keep(optimizer)
        optimizer.grad_sync.lockstep.stepped()  # this step() call ended, on every rank
        optimizer._end_iteration()
        what = (
            "clipped the grads (clip_grad_norm)"
            if clipped
            else "used a GradScaler"
            if scaled
            else f"ran {rounds + 1} synchronised backward passes"
        )
        raise RuntimeError(
            f"{type(optimizer).__name__}: this iteration {what}, but CPU offload updated "
            "buckets during backward (CPUOffload(overlap_backward=...) is on, see "
            f"docs/offload.md); {_HOW}. No step was taken (the step count did not move and this "
            "iteration's grads are dropped), but the buckets updated during backward keep "
            "their update (on every rank): resume from a checkpoint to undo it, or go on with "
            "zero_grad() and the next batch"
        )

    def at_step(self) -> tuple[Progress | None, set]:
        """``step()`` (after ``check``): the progress and buckets of the updates started
        during backward."""
        progress, done = self.progress, self.done
        self.reset()
        return progress, done

    def dropped(self, optimizer) -> None:
        """``zero_grad()`` drops this iteration's grads: once buckets were launched (their
        update may have started), every rank checks lockstep, keeps the updates and warns."""
        it = optimizer.grad_sync.iteration
        if not self.on or not it.next_launch:
            self.reset()
            return
        grad_sync = optimizer.grad_sync
        if grad_sync.checks_lockstep:  # a rank alone here: LockstepError on every rank
            grad_sync.check_lockstep(PHASE_DROP)
        if not self._updated(optimizer):
            self.reset()
            return
        self._keep(optimizer)
        warnings.warn(
            f"{type(optimizer).__name__}: zero_grad() dropped grads that CPU offload already "
            "used (CPUOffload(overlap_backward=...) is on): the buckets updated during "
            "backward keep this batch's update (their state and params, on every rank), the "
            "others drop it. To skip batches after backward exactly, pass "
            "offload=shardopt.CPUOffload(overlap_backward=False)",
            stacklevel=2,
        )

    def before_state_io(self, optimizer, call: str) -> None:
        """A collective state I/O ``call`` arrived on every rank: raises on every rank when some
        rank updated a bucket during this iteration's backward (see Note: state I/O between
        backward and step)."""
        if self.mode is not False and self._updated(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__}: {call} between backward and step(): CPU offload "
                "already updated buckets with this iteration's grads (CPUOffload("
                "overlap_backward=...) is on, see docs/offload.md), so the state holds part of "
                "a step not taken yet. Call it after step() (or before backward); to roll back "
                "here, call zero_grad() first (the buckets updated during backward keep their "
                "update) and load a checkpoint with the model's weights; or pass "
                "offload=shardopt.CPUOffload(overlap_backward=False). Nothing was changed: "
                "step() goes on as before"
            )


def _early(optimizer) -> EarlyUpdates | None:
    pipeline = getattr(optimizer, "_offload_pipeline", None)
    return None if pipeline is None else pipeline.early


def check_early(optimizer, scalars) -> None:
    """``step()``, before the step counts move: raises on every rank when this iteration's
    updates during backward are inexact (see Note: updates during backward)."""
    early = _early(optimizer)
    if early is not None:
        early.check(optimizer, scalars)


def before_state_io(optimizer, call: str) -> None:
    """A collective state I/O ``call`` has arrived on every rank (see Note: state I/O between
    backward and step)."""
    early = _early(optimizer)
    if early is not None:
        early.before_state_io(optimizer, call)
