"""CPU offload settings on gloo: agreed across ranks, bounded, and what a fraction below 1 keeps.

- ``fraction`` (``"auto"`` or a number), ``overlap_backward`` and offload itself differing
  between ranks: a ValueError naming the setting on every rank, before any collective that
  depends on them (``fraction="auto"`` runs collectives the other ranks would skip), also
  between HSDP replicas; no hang.
- ``staging_slots`` and ``threads`` have upper bounds (a ValueError naming the field and the
  bound: ``staging_slots`` when the ``CPUOffload`` is made, ``threads`` against the host's CPUs
  on every rank when the optimizer is built, also when only one rank got it wrong), not an
  allocation that grows until the kernel kills the process or an overflow deep in torch.
- A host allocation that fails names the offloaded state, the bytes asked for and the remedies,
  on every rank (also when only one rank's allocation failed), at construction and for the
  staging slots; at auto's re-plan every rank keeps the fraction in effect instead.
- Offload is visible without logging configured: one stderr line on rank 0 per optimizer,
  none once a handler is configured (an INFO line instead); ``str(optimizer.offload_plan)``.
- ``fraction < 1`` at world 3: the offloaded and the GPU part of the shard are updated with the
  bits of no offload (grads that one rank alone contributes, so that the reduce-scatter's order
  of summation, which depends on the key split at three ranks or more, changes no bit).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os

import pytest
import torch
from dist_harness import run_cases
from test_offload import BF16, _model, _opt, _same, _train
from test_offload_auto import ENV, HALF, _forced, _Records

import shardopt
from shardopt.zero.offload import host_memory
from shardopt.zero.offload import plan as offload_plan


def _history(name, dtype, offload, rank, **train_kw):
    model = _model(dtype)
    opt = _opt(name, model, offload)
    history = []

    def each(step):
        opt.wait_param_sync()
        history.append([p.detach().clone() for p in model.parameters()])

    _train(model, opt, rank, range(4), each=each, **train_kw)
    return history, opt


def settings_differ(rank, world):
    """Each mismatch raises on every rank, naming the setting (world 3: rank 0 differs from the
    others, and the last rank from the others)."""
    model = _model(torch.float32)
    auto, half = shardopt.CPUOffload(fraction="auto"), shardopt.CPUOffload(fraction=0.5)
    cases = [
        (auto if rank == 0 else half, "CPUOffload.fraction: rank 0 has 'auto', rank 1 has 0.5"),
        (half if rank < world - 1 else auto, f"rank 0 has 0.5, rank {world - 1} has 'auto'"),
        (None if rank == world - 1 else auto, f"offload: rank 0 has CPU offload, rank {world - 1}"),
        (
            shardopt.CPUOffload(overlap_backward=rank == 1),
            "CPUOffload.overlap_backward: rank 0 has False, rank 1 has True",
        ),
    ]
    for offload, match in cases:
        with pytest.raises(ValueError, match="CPU offload settings differ") as info:
            _opt("Adam", model, offload)
        assert match in str(info.value), (match, str(info.value))
    # what only tunes this host's update may differ: the same bits as without offload
    mine = shardopt.CPUOffload(staging_slots=1 + rank, threads=1, pin_memory=rank == 0)
    plain, _ = _history("Adam", BF16, None, rank)
    tuned, _ = _history("Adam", BF16, mine, rank)
    _same(plain, tuned, "staging_slots/pin_memory per rank")


def hsdp_settings_differ(rank, world):
    """HSDP, two shard groups of two: each group agrees within itself, the replicas differ
    (ranks 2-3 ask for auto): every rank raises, none waits in a collective another skips."""
    groups = shardopt.zero.hsdp_groups(2)._asdict()
    offload = shardopt.CPUOffload(fraction="auto" if rank >= 2 else 0.5)
    with pytest.raises(ValueError, match="CPUOffload.fraction: rank 0 has 0.5, rank 2 has 'auto'"):
        _opt("Adam", _model(torch.float32), offload, **groups)
    _opt("Adam", _model(torch.float32), shardopt.CPUOffload(fraction=0.5), **groups)


def bounds(rank, world):
    """``staging_slots`` is bounded at construction (no process group needed); ``threads``
    against this host's CPUs when the optimizer is built, on every rank (also where one rank's
    host has fewer: that rank raises, the others name it, none hangs)."""
    model = _model(torch.float32)
    for slots in (10**9, offload_plan.MAX_STAGING_SLOTS + 1):
        with pytest.raises(ValueError, match="^CPUOffload.staging_slots must be .* at most"):
            shardopt.CPUOffload(staging_slots=slots)
    for threads in (2**31, offload_plan.max_threads() + 1):
        with pytest.raises(ValueError, match="Adam: CPUOffload.threads must be .* at most"):
            _opt("Adam", model, shardopt.CPUOffload(threads=threads))
    # wrong on one rank only: every rank raises
    one = shardopt.CPUOffload(threads=2**31 if rank == world - 1 else 1)
    with pytest.raises(ValueError, match="threads"):
        _opt("Adam", model, one)
    top = shardopt.CPUOffload(
        staging_slots=offload_plan.MAX_STAGING_SLOTS, threads=offload_plan.max_threads()
    )
    _opt("Adam", model, top)  # the bounds themselves are fine


def _failing(only_rank, rank, after=0):
    """``host_memory``'s allocator failing as torch's does, on ``only_rank`` (after ``after``
    allocations); returns the undo."""
    real = host_memory._allocate
    calls = [0]

    def allocate(numel, dtype):
        calls[0] += 1
        if rank == only_rank and calls[0] > after:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
                f"memory: you tried to allocate {numel * dtype.itemsize} bytes."
            )
        return real(numel, dtype)

    host_memory._allocate = allocate
    return lambda: setattr(host_memory, "_allocate", real)


def host_allocation_fails(rank, world):
    """The state on the host (construction), the staging slots (after the state) and a re-plan's
    state: every rank raises, the failing one naming what, how many bytes and the remedies."""
    model = _model(torch.float32)
    for after in (0, 3):  # 0: the master; 3: the first staging slot (master + 2 moments first)
        undo = _failing(world - 1, rank, after)
        try:
            with pytest.raises(host_memory.HostMemoryError) as info:
                _opt("Adam", model, "cpu")
        finally:
            undo()
        text = str(info.value)
        if rank == world - 1:
            what = "the CPU offload's host state" if after == 0 else "a staging slot"
            assert what in text and "bytes of host memory" in text, text
            for remedy in ("fraction", "state_format", "staging_slots", "more ranks"):
                assert remedy in text, (remedy, text)
        else:
            assert f"rank {world - 1} failed" in text, text
    _opt("Adam", model, "cpu")  # the allocator back: fine


def replan_allocation_fails(rank, world):
    """auto's re-plan (forced to 0.5) cannot allocate the host state (or, after it, the first
    staging slot, when the new keys' hooks are in place) on the last rank: every rank keeps the
    fraction in effect (0 on a CPU job), with the reason, and trains on with the bits of no
    offload."""
    model = _model(torch.float32)
    plain = _opt("Adam", model, None)
    expected = []
    _train(model, plain, rank, range(6), each=lambda s: expected.append(
        [p.detach().clone() for p in model.parameters()]))  # fmt: skip
    for after in (0, 3):
        _forced(HALF)
        undo = None
        try:
            model = _model(torch.float32)
            opt = _opt("Adam", model, shardopt.CPUOffload(fraction="auto"))
            undo = _failing(world - 1, rank, after)  # from now on: the re-plan's allocations
            history = []

            def each(step, m=model, o=opt, out=history):
                o.wait_param_sync()
                out.append([p.detach().clone() for p in m.parameters()])

            _train(model, opt, rank, range(6), each=each)
        finally:
            os.environ.pop(ENV, None)
            if undo is not None:
                undo()
        plan = opt.offload_plan
        assert plan.fraction == 0.0 and plan.replanned_at_step == 3, plan
        assert "could not hold the offloaded state of fraction 0.500" in plan.reason, plan
        assert not any(k.buffers.offloaded for k in opt.keys)
        _same(history, expected, f"after a failed re-plan ({after}) vs no offload")
        _same(opt.state_dict(), plain.state_dict(), "state_dict")
        opt.close()


def partial_fraction_world3(rank, world):
    """fraction 0.5 at world 3: the host part and the GPU part of the shard give the bits of no
    offload for every elementwise class, fp32 params (grads of rank 0 alone: adding zeros is
    exact in any order); with every rank's fp32 grads the key split changes which rank owns an
    element and so the order gloo adds the three ranks' grads in (see docs/offload.md)."""
    assert world == 3
    half = shardopt.CPUOffload(fraction=0.5)
    for name in ("Adam", "SGD", "Adagrad"):
        plain, _ = _history(name, torch.float32, None, rank, solo=True)
        split, opt = _history(name, torch.float32, half, rank, solo=True)
        assert [k.buffers.offloaded for k in opt.keys] == [True, False]
        _same(plain, split, f"{name} fraction 0.5 at world 3")


def _announced(build) -> tuple[object, list[str]]:
    """(what ``build()`` returned, the lines of shardopt's it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = build()
    return result, [line for line in err.getvalue().splitlines() if "shardopt:" in line]


def offload_is_visible(rank, world):
    """Without logging configured, rank 0 prints one line per offloading optimizer to stderr
    (none for one without offload, none at auto's re-plan or in steps); with a handler on the
    ``shardopt`` logger, nothing on stderr and one INFO line instead. ``str(offload_plan)`` says
    what is where on every rank (see Note: offload is visible in shardopt/zero/offload/auto.py)."""
    logger = logging.getLogger("shardopt")
    assert not logger.hasHandlers(), "the case needs a process without logging configured"
    mine = 1 if rank == 0 else 0
    model = _model(torch.float32)
    opt, lines = _announced(lambda: _opt("Adam", model, "cpu"))
    assert len(lines) == mine, lines
    if rank == 0:
        assert "DistributedFusedAdam: CPU offload is on" in lines[0], lines
        assert f"{opt.offload_plan.host_params} params on the host" in lines[0], lines
        assert "print(optimizer.offload_plan)" in lines[0], lines
    text = str(opt.offload_plan)
    assert text.startswith("CPU offload at fraction 1.000 (asked: 1.0):"), text
    assert f"{opt.offload_plan.host_params} params" in text and "fraction=1.0 as requested" in text
    _, lines = _announced(lambda: _train(model, opt, rank, range(2)))
    assert lines == [], lines
    opt.close()
    _, lines = _announced(lambda: _opt("Adam", _model(torch.float32), None))
    assert lines == [], lines
    _forced(HALF)  # auto re-plans to 0.5 after step 3: a rebuild, announced no second time
    try:
        model = _model(torch.float32)
        opt, lines = _announced(lambda: _opt("Adam", model, shardopt.CPUOffload("auto")))
        assert len(lines) == mine and (not lines or "fraction='auto'" in lines[0]), lines
        _, lines = _announced(lambda: _train(model, opt, rank, range(5)))
        assert opt.offload_plan.replanned_at_step == 3 and lines == [], lines
        assert str(opt.offload_plan).startswith("CPU offload at fraction 0.500 (asked: 'auto')")
    finally:
        os.environ.pop(ENV, None)
    opt.close()
    records = _Records()
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        opt, lines = _announced(lambda: _opt("Adam", _model(torch.float32), "cpu"))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert lines == [], lines
    assert records.lines == ([f"DistributedFusedAdam: {opt.offload_plan}"] if mine else [])


PLAN = [
    (1, [offload_is_visible]),
    (2, [settings_differ, bounds, host_allocation_fails, replan_allocation_fails]),
    (
        3,
        [
            settings_differ,
            bounds,
            host_allocation_fails,
            replan_allocation_fails,
            partial_fraction_world3,
            offload_is_visible,
        ],
    ),
    (4, [hsdp_settings_differ]),
]


@pytest.fixture(scope="module")
def results():
    out = {}
    for world, cases in PLAN:
        found = run_cases(cases, world, timeout=300, pg_timeout=60, report_hangs=True)
        for name, err in found.items():
            out[(world, name)] = err
    return out


@pytest.mark.parametrize(
    "world,case",
    [(w, c) for w, cases in PLAN for c in cases],
    ids=lambda v: f"world{v}" if isinstance(v, int) else v.__name__,
)
def test_offload_settings(results, world, case):
    err = results[(world, case.__name__)]
    assert err is None, err
