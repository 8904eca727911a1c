"""CPU offload with ``fraction="auto"`` on gloo: the first steps are timed, the fraction is
re-planned once at a step boundary, and the run stays exact.

- The decision forced through ``SHARDOPT_OFFLOAD_AUTO_MEASURED`` (a CPU job alone keeps 0): the
  re-plan after step 3 gives, at every step and in ``state_dict()``, the bits of the re-plan
  done by hand (fraction 0, ``state_dict()``, an optimizer built with the chosen fraction), with
  clipping, ``overlap_param_sync`` and updates during backward too; at worlds 1-2 without
  clipping (where the key split changes no bit) those of the chosen fraction from the start and
  of no offload; the same key split and ``memory_bytes()`` as the chosen fraction from the
  start, and the GPU bytes saved.
- Every class, with a param that never gets a grad: nothing derived from the old keys (NovoGrad's
  used-params masks) is reused after the re-plan; the run is the re-plan by hand's bit for bit.
- Checkpoints (``state_dict()``) taken before and after the re-plan load into an optimizer
  without offload and into another auto one, and continue the run bit for bit; sharded ones
  (``shardopt.checkpoint``) saved at world 2 resume at world 3 without offload, with full
  offload and with auto, to the same final params.
- The decision is logged once (``shardopt`` logger), none at construction; the same on every
  rank, and with HSDP the first replica's on every replica.
- Bad values of the environment variable are named, on every rank, at construction; a failed
  measurement at the re-plan keeps the fraction on every rank.
- ``plan_fraction``'s model and the timer are tested as data.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases
from test_offload import BF16, CLASSES, FORMATS, _model, _opt, _same, _train

import shardopt
from shardopt import checkpoint
from shardopt.zero.offload import replan as offload_replan
from shardopt.zero.offload.measure import BackwardTimer
from shardopt.zero.offload.plan import plan_fraction

ENV = offload_replan.MEASURED_ENV
ROOT = "SHARDOPT_TEST_OFFLOAD_AUTO_ROOT"
#: per element: CPU update + copies 1e-6 ms with the headroom, GPU update 1e-6 ms, nothing to
#: hide in: the two sides meet at fraction 0.5
HALF = {"cpu_ms": 0.75e-6 / offload_replan.HEADROOM, "copy_ms": 0.25e-6 / offload_replan.HEADROOM,
        "gpu_ms": 1e-6, "free_bytes": 1e12, "forward_ms": 0.0, "backward_ms": 0.0}  # fmt: skip
STEPS = range(6)
#: LAMB with a key split against without (see replan_rebuilds_plan_caches): fp32 rounding of a
#: regrouped sum; bf16 params: one bf16 rounding step where that flips it
LAMB_SPLIT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), BF16: dict(rtol=8e-3, atol=1e-5)}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _forced(values):
    os.environ[ENV] = json.dumps(values)


def _scaler(scaled):
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) if scaled else None


def _run(name, dtype, offload, rank, *, kw=None, steps=STEPS, clip=None, scaled=False):
    model = _model(dtype)
    opt = _opt(name, model, offload, **(kw or {}))
    history = []

    def each(step):
        opt.wait_param_sync()
        history.append([p.detach().clone() for p in model.parameters()])

    _train(
        model,
        opt,
        rank,
        steps,
        each=each,
        clip=clip,
        scaler=_scaler(scaled),
        inf_at=4 if scaled else None,
    )  # fmt: skip (an inf skips the step after the re-plan)
    return opt, history


def _check_same(a, b, what, tol=None):
    (opt_a, hist_a), (opt_b, hist_b) = a, b
    for step, (x, y) in enumerate(zip(hist_a, hist_b)):
        _same(x, y, f"{what}: params after step {step}", tol)
    _same(opt_a.state_dict(), opt_b.state_dict(), f"{what}: state_dict", tol)


def _by_hand(name, dtype, fraction, rank, kw, clip, scaled=False):
    """The re-plan done by hand: fraction 0 for steps 0-2, then its state_dict() loaded into
    an optimizer built with ``fraction``. (Another key split changes which rank owns an
    element, so with three ranks or more the order gloo sums the grads in, and with clipping
    the order of the global norm's sum: the steps before the re-plan are fraction 0's, whose
    bits then differ from those of fraction 0.5 from the start.)"""
    model = _model(dtype)
    opt = _opt(name, model, shardopt.CPUOffload(fraction=0.0), **kw)
    history = []

    def each(step, o):
        o.wait_param_sync()
        history.append([p.detach().clone() for p in model.parameters()])

    scaler = _scaler(scaled)
    inf_at = 4 if scaled else None
    _train(model, opt, rank, STEPS[:3], each=lambda s: each(s, opt), clip=clip, scaler=scaler)
    saved = opt.state_dict()
    opt.close()
    after = _opt(name, model, shardopt.CPUOffload(fraction=fraction), **kw)
    after.load_state_dict(saved)
    _train(model, after, rank, STEPS[3:], each=lambda s: each(s, after), clip=clip,
           scaler=scaler, inf_at=inf_at)  # fmt: skip
    return after, history


def replan_is_exact(rank, world):
    """A forced 0.5: from step 4 on the run is that of fraction 0.5 from the start, bit for bit."""
    _forced(HALF)
    try:
        cases = [
            ("Adam", torch.float32, {}, None),
            ("Adam", BF16, {}, 1.0),
            ("SGD", BF16, dict(overlap_param_sync=True), None),
            ("Adam", BF16, FORMATS["remainders_int8"][1], None),
            ("Adam", torch.float32, FORMATS["int8"][1], None),
        ]  # (with clipping the steps before the re-plan are those of fraction 0: see below)
        for name, dtype, kw, clip in cases:
            auto = _run(name, dtype, shardopt.CPUOffload(fraction="auto"), rank, kw=kw, clip=clip)
            opt = auto[0]
            plan = opt.offload_plan
            assert plan.requested == "auto" and plan.replanned_at_step == 3, plan
            assert plan.fraction == pytest.approx(0.5), plan
            fixed = _run(
                name, dtype, shardopt.CPUOffload(fraction=plan.fraction), rank, kw=kw, clip=clip
            )
            by_hand = _by_hand(name, dtype, plan.fraction, rank, kw, clip)
            _check_same(auto, by_hand, f"{name} {dtype} auto vs a re-plan by hand")
            if clip is None and world <= 2:  # see _by_hand: then the split changes no bit
                _check_same(auto, fixed, f"{name} {dtype} auto vs fraction {plan.fraction}")
            flags = [(k.buffers.offloaded, k.layout.params) for k in opt.keys]
            assert flags == [(k.buffers.offloaded, k.layout.params) for k in fixed[0].keys]
            assert [f for f, _ in flags] == [True, False], flags
            assert opt.memory_bytes() == fixed[0].memory_bytes()
            host = opt.memory_bytes("host")
            assert host == fixed[0].memory_bytes("host") and host
            assert plan.device_bytes_saved == fixed[0].offload_plan.device_bytes_saved > 0
            # fp32 params: the host master is a copy of the params, the moments moved
            moved = {n: b for n, b in host.items() if n != "staging"}
            if dtype == torch.float32:
                moved.pop("master")
            assert plan.device_bytes_saved == sum(moved.values()), (plan, host)
            if clip is None and world <= 2:  # no offload's bits too
                _check_same(auto, _run(name, dtype, None, rank, kw=kw), f"{name} vs no offload")
        # a GradScaler across the re-plan, an inf on rank 0 at step 4 skipping it everywhere
        auto = _run("Adam", BF16, shardopt.CPUOffload(fraction="auto"), rank, clip=1.0,
                    scaled=True)  # fmt: skip
        fraction = auto[0].offload_plan.fraction
        by_hand = _by_hand("Adam", BF16, fraction, rank, {}, 1.0, scaled=True)
        _check_same(auto, by_hand, "GradScaler: auto vs a re-plan by hand")
        _same(auto[1][3], auto[1][4], "the inf at step 4 skipped it")
        # updates during backward after the re-plan ("auto": from the second clean step)
        early = shardopt.CPUOffload(fraction="auto", overlap_backward="auto")
        auto = _run("Adam", BF16, early, rank)
        assert auto[0].offload_plan.fraction == pytest.approx(0.5)
        assert "backward" in auto[0].offload_plan.reason
        by_hand = _by_hand("Adam", BF16, auto[0].offload_plan.fraction, rank, {}, None)
        _check_same(auto, by_hand, "overlap_backward auto vs a re-plan by hand")
    finally:
        os.environ.pop(ENV, None)


def replan_rebuilds_plan_caches(rank, world):
    """Every class with a param that never gets a grad (``Net.unused``) across the re-plan: what
    was derived from the old keys (NovoGrad's used-params masks, the planned calls, state I/O's
    copies) is not reused by the new ones, so the steps after it are the re-plan by hand's bit
    for bit and no offload's: bit for bit too, except LAMB, whose norms sum one partial per key
    (and fragment) at every world size, so a split regroups the sum (``LAMB_SPLIT_TOL``)."""
    _forced(HALF)
    try:
        for name in CLASSES:
            for dtype in (torch.float32, BF16):
                auto = _run(name, dtype, shardopt.CPUOffload(fraction="auto"), rank)
                plan = auto[0].offload_plan
                assert plan.replanned_at_step == 3 and plan.fraction == pytest.approx(0.5), plan
                assert auto[0].update_calls.unused, "Net.unused must get no grad"
                by_hand = _by_hand(name, dtype, plan.fraction, rank, {}, None)
                _check_same(auto, by_hand, f"{name} {dtype} auto vs a re-plan by hand")
                # LAMB: the clip's sum of squares (and the per-param norms) add one partial per
                # key (per fragment), so splitting a key regroups the fp32 sum: a few ulps
                tol = LAMB_SPLIT_TOL[dtype] if name == "LAMB" else None
                none = _run(name, dtype, None, rank)
                _check_same(auto, none, f"{name} {dtype} vs none", tol)
    finally:
        os.environ.pop(ENV, None)


def hsdp_replicas_agree(rank, world):
    """HSDP (2 ranks per shard group): the second replica's rank 0 would pick another fraction;
    every rank takes the first replica's, and the run is the re-plan by hand's."""
    groups = shardopt.zero.hsdp_groups(2)._asdict()
    ranks = dist.get_process_group_ranks(groups["process_group"])
    _forced(HALF if 0 in ranks else dict(HALF, gpu_ms=3e-6))
    try:
        auto = _run("Adam", BF16, shardopt.CPUOffload(fraction="auto"), rank, kw=groups)
        fraction = auto[0].offload_plan.fraction
        assert fraction == pytest.approx(0.5), auto[0].offload_plan
        by_hand = _by_hand("Adam", BF16, fraction, rank, groups, None)
        _check_same(auto, by_hand, "HSDP auto vs a re-plan by hand")
    finally:
        os.environ.pop(ENV, None)


def checkpoints_across_the_replan(rank, world):
    """state_dict() before (step 1) and after (step 4) the re-plan: loaded without offload and
    into another auto optimizer, the rest of the run is the same bits."""
    _forced(HALF)
    try:
        model = _model(BF16)
        opt = _opt("Adam", model, shardopt.CPUOffload(fraction="auto"))
        saved, history = {}, {}

        def each(step):
            opt.wait_param_sync()
            history[step] = [p.detach().clone() for p in model.parameters()]
            if step in (1, 4):
                params = {k: v.clone() for k, v in model.state_dict().items()}
                saved[step] = (opt.state_dict(), params)

        _train(model, opt, rank, STEPS, each=each)
        assert opt.offload_plan.replanned_at_step == 3
        for at, offload in ((1, None), (1, shardopt.CPUOffload(fraction="auto")), (4, None),
                            (4, shardopt.CPUOffload(fraction=0.5)), (4, "cpu")):  # fmt: skip
            other = _model(BF16, seed=7)
            other.load_state_dict(saved[at][1])
            resumed = _opt("Adam", other, offload)
            resumed.load_state_dict(saved[at][0])
            after = {}

            def keep(step, m=other, o=resumed, out=after):
                o.wait_param_sync()
                out[step] = [p.detach().clone() for p in m.parameters()]

            _train(other, resumed, rank, range(at + 1, len(STEPS)), each=keep)
            for step, params in after.items():
                _same(params, history[step], f"resumed at {at} with {offload}, step {step}")
            _same(resumed.state_dict(), opt.state_dict(), f"resumed at {at} with {offload}")
    finally:
        os.environ.pop(ENV, None)


def _solo_opt(model, offload):
    return _opt("Adam", model, offload, average_grad_sync=False)


def save_w2(rank, world):
    """World 2, auto forced to 0.5 (only rank 0's grads count, so the run does not depend on
    the world size): sharded checkpoints after step 1 (before the re-plan) and step 4 (after)."""
    root = Path(os.environ[ROOT])
    _forced(HALF)
    try:
        model = _model(BF16)
        opt = _solo_opt(model, shardopt.CPUOffload(fraction="auto"))

        def each(step):
            if step in (1, 4):
                checkpoint.save(root / f"auto-{step}", opt, model)

        _train(model, opt, rank, STEPS, each=each, solo=True)
        assert opt.offload_plan.replanned_at_step == 3 and opt.offload_plan.fraction == 0.5
        if rank == 0:
            torch.save(model.state_dict(), root / "auto-final.pt")
    finally:
        os.environ.pop(ENV, None)


def resume_w3(rank, world):
    """World 3 resumes both checkpoints without offload, with full offload and with auto (which
    re-plans on its own third step): the final params of the world-2 run, bit for bit."""
    root = Path(os.environ[ROOT])
    expected = torch.load(root / "auto-final.pt", weights_only=True)
    _forced(HALF)
    try:
        for at in (1, 4):
            for offload in (None, "cpu", shardopt.CPUOffload(fraction="auto")):
                model = _model(BF16, seed=5)
                opt = _solo_opt(model, offload)
                checkpoint.load(root / f"auto-{at}", opt, model)
                _train(model, opt, rank, range(at + 1, len(STEPS)), solo=True)
                for k, v in model.state_dict().items():
                    assert torch.equal(v, expected[k]), (at, offload, k)
    finally:
        os.environ.pop(ENV, None)


def logged_once(rank, world):
    """One INFO line with the decision (rank 0), none at construction; a CPU job keeps 0."""
    records = _Records()
    logger = logging.getLogger("shardopt")
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model = _model(torch.float32)
        opt = _opt("Adam", model, shardopt.CPUOffload(fraction="auto"))
        plan = opt.offload_plan
        assert plan.fraction == 0.0 and plan.replanned_at_step is None, plan
        assert plan.reason.startswith("auto at construction"), plan
        assert not [line for line in records.lines if "CPU offload" in line], records.lines
        _train(model, opt, rank, STEPS)
        plan = opt.offload_plan
        assert plan.fraction == 0.0 and plan.replanned_at_step == 3, plan
        assert "CPU job" in plan.reason and {"backward_ms", "forward_ms"} <= set(plan.measurements)
        assert plan.measurements["backward_ms"] > 0
        lines = [line for line in records.lines if "CPU offload" in line]
        assert len(lines) == (1 if rank == 0 else 0), lines
        if rank == 0:
            assert "fraction 0.000 after step 3" in lines[0] and "CPU job" in lines[0], lines
        everyone = [None] * world
        dist.all_gather_object(everyone, (plan.fraction, plan.reason))
        assert all(e == everyone[0] for e in everyone), everyone
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def bad_inputs(rank, world):
    """A bad environment value is named at construction, on every rank (rank 0 reads it)."""
    model = _model(torch.float32)
    auto = shardopt.CPUOffload(fraction="auto")
    bad = ["not json", json.dumps([1]), json.dumps({"cpu": 1}), json.dumps({"cpu_ms": -1})]
    try:
        for text in bad:
            os.environ[ENV] = text
            with pytest.raises(ValueError, match=ENV):
                _opt("Adam", model, auto)
        os.environ[ENV] = bad[0] if rank == 0 else json.dumps(HALF)  # wrong on rank 0 only
        with pytest.raises(ValueError, match=ENV):
            _opt("Adam", model, auto)
    finally:
        os.environ.pop(ENV, None)
    _opt("Adam", model, auto)  # unset again: fine


def failed_measurement(rank, world):
    """A failure to measure on rank 0 at the re-plan keeps the fraction on every rank (no rank
    waits for another, no rank raises mid-training)."""
    model = _model(torch.float32)
    opt = _opt("Adam", model, shardopt.CPUOffload(fraction="auto"))
    try:
        _train(model, opt, rank, range(2))
        os.environ[ENV] = "not json"  # read again by rank 0 at the re-plan
        _train(model, opt, rank, range(2, 5))
    finally:
        os.environ.pop(ENV, None)
    plan = opt.offload_plan
    assert plan.fraction == 0.0 and plan.replanned_at_step == 3, plan
    assert "could not measure" in plan.reason and ENV in plan.reason, plan


PLAN = [
    (
        1,
        [
            replan_is_exact,
            replan_rebuilds_plan_caches,
            checkpoints_across_the_replan,
            logged_once,
            bad_inputs,
        ],
    ),
    (
        2,
        [
            replan_is_exact,
            replan_rebuilds_plan_caches,
            logged_once,
            bad_inputs,
            failed_measurement,
            save_w2,
        ],
    ),
    (3, [replan_is_exact, checkpoints_across_the_replan, logged_once, resume_w3]),
    (4, [hsdp_replicas_agree]),
]


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[ROOT] = tmp
        out = {}
        try:
            for world, cases in PLAN:
                for name, err in run_cases(cases, world, timeout=600).items():
                    out[(world, name)] = err
            return out
        finally:
            os.environ.pop(ROOT, None)


@pytest.mark.parametrize(
    "world,case",
    [(w, c) for w, cases in PLAN for c in cases],
    ids=lambda v: f"world{v}" if isinstance(v, int) else v.__name__,
)
def test_offload_auto(results, world, case):
    err = results[(world, case.__name__)]
    assert err is None, err


def test_plan_fraction_model():
    gib = 2.0**30
    # n=1e9: GPU update 50 ms, CPU update + copies 1200 ms
    base = dict(numel=10**9, device_bytes_per_param=12.0, cpu_ms_per_param=1e-6,
                copy_ms_per_param=2e-7, gpu_ms_per_param=5e-8)  # fmt: skip
    # nothing to hide in: the CPU part runs beside the GPU update of the rest, 50/1250
    f, reason = plan_fraction(**base, free_device_bytes=100 * gib, window_ms=0.0)
    assert f == pytest.approx(0.04) and "fraction 0.040" in reason
    # a window of 1150 ms: 1200/1250
    f, _ = plan_fraction(**base, free_device_bytes=100 * gib, window_ms=1150.0)
    assert f == pytest.approx(0.96)
    f, _ = plan_fraction(**base, free_device_bytes=100 * gib, window_ms=2000.0)
    assert f == 1.0  # the whole CPU update hides
    # the headroom scales the CPU side: 50/(50 + 1500)
    f, _ = plan_fraction(**base, free_device_bytes=100 * gib, window_ms=0.0, headroom=1.25)
    assert f == pytest.approx(50 / 1550)
    # a third of the state fits: the memory floor wins over the faster split
    f, _ = plan_fraction(**base, free_device_bytes=4e9, window_ms=0.0)
    assert f == pytest.approx(1 - 4e9 / 12e9)
    f, _ = plan_fraction(**base, free_device_bytes=0.0, window_ms=0.0)
    assert f == 1.0
    assert plan_fraction(**dict(base, numel=0), free_device_bytes=0.0, window_ms=0.0)[0] == 1.0
    with pytest.raises(ValueError, match="window"):
        plan_fraction(**base, free_device_bytes=0.0, window_ms=-1.0)
    with pytest.raises(ValueError, match="headroom"):
        plan_fraction(**base, free_device_bytes=0.0, window_ms=0.0, headroom=0.5)


def test_timer_keeps_the_measured_steps():
    """On a CPU job: step 1 is a warm-up; a zero_grad() outside a step drops the backward."""

    class _Sync:
        before_sync = on_launch = None
        enabled = True

    sync = _Sync()
    timer = BackwardTimer(torch.device("cpu"))
    timer.install(sync)

    def backward(seconds):
        timer._in_backward()
        time.sleep(seconds)
        sync.on_launch(None, 0, None)

    backward(0.0)
    timer.step_ended(measured=False)
    time.sleep(0.02)  # the forward
    backward(0.05)
    timer.step_ended(measured=True)
    backward(0.01)
    timer.dropped()
    timer.step_ended(measured=True)  # nothing since the drop: no sample
    assert len(timer.samples) == 1
    forward, backward_ms = timer.windows()
    assert 15 <= forward < 200 and 40 <= backward_ms < 500, timer.samples
    timer.remove()
    assert sync.before_sync is None and sync.on_launch is None
    assert BackwardTimer(torch.device("cpu")).windows() == (0.0, 0.0)
