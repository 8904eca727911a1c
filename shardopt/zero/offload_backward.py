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
    then clips, passes a GradScaler or ran a second synchronised backward, ``step()`` raises on
    every rank (the conditions do not depend on the rank); so does ``zero_grad()`` dropping
    grads whose buckets may have been updated. The hyperparameters (lr, ...) are read when a
    bucket's update starts: a scheduler stepped before backward is seen, a change between
    backward and ``step()`` is not (for the early buckets). HSDP keeps it off (the grads take
    one more all-reduce after the reduce-scatters).
"""

from __future__ import annotations

import weakref
from typing import Literal

import torch

from shardopt.zero.amp import StepScalars
from shardopt.zero.offload_worker import Progress, forward_order, frozen_view

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

    def at_step(self, optimizer, scalars: StepScalars) -> tuple[Progress | None, set]:
        """``step()``: the progress and buckets of the updates started during backward; raises
        on every rank when this iteration made them inexact."""
        clipped = optimizer.amp.max_norm is not None
        scaled = scalars.found_inf_t is not None
        rounds = optimizer.grad_sync.iteration.rounds
        active = self.on
        self.clean_before = not (clipped or scaled or rounds)
        if active and not self.clean_before:
            self._abandon()
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
                f"docs/offload.md); {_HOW}. The offloaded state of this step is partly "
                "updated: resume from a checkpoint"
            )
        progress, done = self.progress, self.done
        self.reset()
        return progress, done

    def dropped(self, optimizer) -> None:
        """``zero_grad()`` drops this iteration's grads: refused once buckets were launched
        (their update may have started), on every rank."""
        it = optimizer.grad_sync.iteration
        if not self.on or not it.next_launch:
            return
        self._abandon()
        raise RuntimeError(
            f"{type(optimizer).__name__}: zero_grad() dropped grads that were already "
            "reduce-scattered, but CPU offload updates buckets during backward "
            "(CPUOffload(overlap_backward=...) is on); call step() first, or pass "
            "offload=shardopt.CPUOffload(overlap_backward=False). The offloaded state may be "
            "partly updated: resume from a checkpoint"
        )
