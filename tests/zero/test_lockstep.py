"""Ranks that leave lockstep get a LockstepError naming each rank, never gloo's SIGABRT or a hang.

See Note: lockstep (shardopt/zero/lockstep.py). Each case runs on gloo worlds 1-3 under a
process-group timeout, so a hang or an abort fails it. Out-of-lockstep cases make the last rank
(rank 1 of 2, rank 2 of 3) deviate; every rank must raise, naming every rank. The patterns that
are in lockstep (accumulation without no_sync, every rank dropping a batch, a rank with no
backward) keep working and match a reference; the check adds no collective to a step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_harness import run_cases

import shardopt
from shardopt.zero import comm
from shardopt.zero.lockstep import LockstepError

PG_TIMEOUT = 30.0
BUCKET_MB = 16 * 4 / 2**20  # several buckets
TOL = dict(rtol=1.3e-6, atol=1e-5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _opt(model, **kw):
    return shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, bucket_cap_mb=BUCKET_MB, **kw)


def _backward(model, step, rank, k=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    model(torch.randn(2, 3, generator=gen)).sum().backward()


def _expect_lockstep_error(rank, world, run, *fragments):
    """``run()`` raises LockstepError on every rank, naming every rank and ``fragments``."""
    if world == 1:
        run()  # nothing to differ from
        return
    with pytest.raises(LockstepError) as info:
        run()
    message = str(info.value)
    for r in range(world):
        assert f"rank {r} is " in message, message
    for fragment in fragments:
        assert fragment in message, message


def _deviate(kind, overlap):
    """Three iterations; in the second the last rank deviates as ``kind`` says."""

    def run_on(rank, world):
        model = _model()
        opt = _opt(model, overlap_grad_sync=overlap)
        deviant = rank == world - 1 and world > 1

        def loop():
            for step in range(3):
                _backward(model, step, rank)
                if deviant and step == 1:
                    if kind == "zero_grad":
                        opt.zero_grad()
                    elif kind == "skip_step":
                        continue
                opt.step()
                opt.zero_grad()

        fragment = {
            "zero_grad": "dropped by a zero_grad() before step()",
            "skip_step": "skipped a step()" if overlap else "after 2 synchronised backward passes",
        }[kind]
        _expect_lockstep_error(rank, world, loop, fragment, "step() #2")

    return run_on


def zero_grad_between_backward_and_step(rank, world):
    _deviate("zero_grad", overlap=True)(rank, world)


def zero_grad_between_backward_and_step_no_overlap(rank, world):
    _deviate("zero_grad", overlap=False)(rank, world)


def step_skipped_once(rank, world):
    _deviate("skip_step", overlap=True)(rank, world)


def step_skipped_once_no_overlap(rank, world):
    _deviate("skip_step", overlap=False)(rank, world)


def batch_skipped_after_caught_exception(rank, world):
    """The last rank's loss check raises after its backward; the loop catches it and goes on
    to the next batch (its step() is skipped)."""
    model = _model()
    opt = _opt(model)

    def loop():
        for step in range(3):
            try:
                _backward(model, step, rank)
                if step == 1 and rank == world - 1 and world > 1:
                    raise FloatingPointError("loss is not finite")
                opt.step()
            except FloatingPointError:
                continue
            opt.zero_grad()

    _expect_lockstep_error(rank, world, loop, "skipped a step()")


def _reference_step(ref, ref_opt, grads_of):
    """The reference: DistributedFusedAdam fed the same summed per-rank grads via no_sync."""
    for k, fn in enumerate(grads_of):
        if k < len(grads_of) - 1:
            with ref_opt.no_sync():
                fn(ref)
        else:
            fn(ref)
    ref_opt.step()
    ref_opt.zero_grad()


def accumulation_without_no_sync_is_lockstep(rank, world):
    """Two synchronised backward passes per step on every rank (DDP without no_sync): no error,
    the same result as accumulating with no_sync."""
    for overlap in (True, False):
        model, ref = _model(), _model()
        opt, ref_opt = _opt(model, overlap_grad_sync=overlap), _opt(ref)
        for step in range(3):
            for k in range(2):
                _backward(model, step, rank, k)
            opt.step()
            opt.zero_grad()
            passes = [lambda m, k=k, s=step: _backward(m, s, rank, k) for k in range(2)]
            _reference_step(ref, ref_opt, passes)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, **TOL)


def every_rank_drops_a_batch(rank, world):
    """Every rank runs backward, then zero_grad() and skips that batch: in lockstep; equal to a
    run that never saw the batch."""
    for overlap in (True, False):
        model, ref = _model(), _model()
        opt, ref_opt = _opt(model, overlap_grad_sync=overlap), _opt(ref)
        for step in range(3):
            _backward(model, step, rank)
            if step == 1:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            _backward(ref, step, rank)
            ref_opt.step()
            ref_opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, **TOL)
        opt.zero_grad()  # then every rank calls step() with no grads: nothing changes
        before = copy.deepcopy(model.state_dict())
        _backward(model, 9, rank)
        opt.zero_grad()
        opt.step()
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


def a_rank_without_backward_contributes_zeros(rank, world):
    """The last rank runs no backward in one iteration (an empty batch): not a lockstep error;
    its grads count as zeros, as docs/spec.md says."""
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model), _opt(ref)
    for step in range(2):
        idle = step == 1 and rank == world - 1 and world > 1  # (alone, it would skip the step)
        if not idle:
            _backward(model, step, rank)
        opt.step()
        opt.zero_grad()
        if idle:  # the reference: the idle rank backpropagates a zero loss
            (ref(torch.zeros(2, 3)).sum() * 0.0).backward()
        else:
            _backward(ref, step, rank)
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **TOL)


def check_adds_no_collective(rank, world):
    """A step in lockstep issues exactly the all-reduces it issued before the check existed:
    one (the unused-param flags) for Adam without clipping or a GradScaler."""
    model = _model()
    opt = _opt(model)
    calls = []
    original = comm.all_reduce

    def counting(tensor, group, op="sum", async_op=False):
        calls.append((tuple(tensor.shape), op))
        return original(tensor, group, op, async_op)

    comm.all_reduce = counting
    try:
        for step in range(3):
            _backward(model, step, rank)
            opt.step()
            opt.zero_grad()
    finally:
        comm.all_reduce = original
    assert len(calls) == 3 and all(op == "max" for _, op in calls), calls


CASES = [
    zero_grad_between_backward_and_step,
    zero_grad_between_backward_and_step_no_overlap,
    step_skipped_once,
    step_skipped_once_no_overlap,
    batch_skipped_after_caught_exception,
    accumulation_without_no_sync_is_lockstep,
    every_rank_drops_a_batch,
    a_rank_without_backward_contributes_zeros,
    check_adds_no_collective,
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=400.0, pg_timeout=PG_TIMEOUT, report_hangs=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_lockstep(results, case):
    err = results[case.__name__]
    assert err is None, err
