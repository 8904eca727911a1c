"""Issue 13, faults: a rank SIGKILLed in the middle of a backward, a step, a save or a load.

The ranks run with a process-group timeout of PG_TIMEOUT seconds. Each scenario trains a few steps,
saves a good checkpoint (and, from rank 0, the state it holds), then a victim rank kills itself with
SIGKILL at one point of the next operation. The surviving ranks must not hang: each must raise
(gloo reports the dead peer, at the latest after PG_TIMEOUT) and exit. Afterwards a fresh world
loads the good checkpoint and finds exactly the saved state, and a save that was interrupted left a
directory that load reports as incomplete.

Scenarios (victim, world):
  mid_backward        rank 1 of 2 dies in the backward, some grad buckets already reduce-scattered
  mid_step            rank 1 of 3 dies inside LAMB's update (the others wait in its all-reduce)
  mid_save_writer     rank 1 of 2 dies writing its rank file
  mid_save_publisher  rank 0 of 2 dies writing metadata.json (the last phase of the save)
  mid_load            rank 1 of 2 dies reading its file during checkpoint.load
tests/checkpoint/test_checkpoint.py covers a rank killed after writing its rank file.

A collective call made on rank 0 only (``state_dict()``, ``checkpoint.save``) while the other ranks
train on: rank 0 raises CollectiveCallError within the arrival timeout and exits, and the others
fail as soon as it is gone; nothing waits for the process-group timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from dist_harness import run_cases

import shardopt
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError
from shardopt.checkpoint import format as fmt
from shardopt.checkpoint import metadata as meta

PG_TIMEOUT = 20.0
EXIT_SLACK = 40.0  # seconds a survivor may take beyond PG_TIMEOUT to raise and exit
ROOT = "SHARDOPT_TEST_FAULTS_ROOT"
GLOBAL_MICRO = 12

# scenario -> (victim rank, world size, optimizer class)
SCENARIOS = {
    "mid_backward": (1, 2, "Adam"),
    "mid_step": (1, 3, "LAMB"),
    "mid_save_writer": (1, 2, "Adam"),
    "mid_save_publisher": (0, 2, "Adam"),
    "mid_load": (1, 2, "Adam"),
}
FAST = ("mid_step", "mid_save_publisher")  # CI; the rest in the long mode


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))


def _opt(name, model):
    cls = getattr(shardopt, f"DistributedFused{name}")
    return cls(model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=40 * 4 / 2**20)


def _train_step(model, opt, step, rank, world):
    per = GLOBAL_MICRO // world
    for k in range(per):
        gen = torch.Generator().manual_seed(step * 100 + rank * per + k)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
        loss = nn.functional.mse_loss(model(x), y) * world / GLOBAL_MICRO
        with nullcontext() if k == per - 1 else opt.no_sync():
            loss.backward()
    opt.step()


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _fault(scenario, rank, victim, model, opt, root: Path, world):
    """Runs the operation in which ``victim`` dies."""
    me = rank == victim
    if scenario == "mid_backward":
        if me:  # the first layer's grad comes last: later buckets are already in flight
            model[0].weight.register_hook(_die)
        for s in range(2, 5):
            _train_step(model, opt, s, rank, world)
    elif scenario == "mid_step":
        with mock.patch.object(opt, "_update", _die) if me else nullcontext():
            _train_step(model, opt, 2, rank, world)
    elif scenario == "mid_save_writer":
        _train_step(model, opt, 2, rank, world)
        with mock.patch.object(fmt, "save_tensors", _die) if me else nullcontext():
            checkpoint.save(root / "next", opt, model)
    elif scenario == "mid_save_publisher":
        _train_step(model, opt, 2, rank, world)
        with mock.patch.object(meta, "write_metadata_text", _die) if me else nullcontext():
            checkpoint.save(root / "next", opt, model)
    elif scenario == "mid_load":
        torch.manual_seed(5)
        other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
        other_opt = _opt(opt.__class__.__name__.removeprefix("DistributedFused"), other)
        with mock.patch.object(fmt, "load_file", _die) if me else nullcontext():
            checkpoint.load(root / "good", other_opt, other)
    else:
        raise ValueError(scenario)


def _worker(rank, world, store_path, root, scenario):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    root = Path(root)
    victim, _, name = SCENARIOS[scenario]
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT),
    )
    model = _model()
    opt = _opt(name, model)
    for s in range(2):
        _train_step(model, opt, s, rank, world)
    checkpoint.save(root / "good", opt, model)
    saved = opt.state_dict()
    if rank == 0:
        torch.save({"opt": saved, "model": model.state_dict()}, root / "good-expected.pt")
    dist.barrier()
    record = {"rank": rank}
    start = time.monotonic()
    try:
        _fault(scenario, rank, victim, model, opt, root, world)
        record["outcome"] = "completed"
    except Exception as e:
        record["outcome"] = f"{type(e).__name__}: {e}"[:600]
        record["traceback"] = traceback.format_exc()[-3000:]
    record["elapsed"] = time.monotonic() - start
    (root / f"rank{rank}.json").write_text(json.dumps(record))
    # then exit as a failed training script would: no destroy_process_group


def _spawn(scenario: str, root: Path):
    victim, world, _ = SCENARIOS[scenario]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world, store, str(root), scenario))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        procs[victim].join(240)
        died = time.monotonic()
        for r, p in enumerate(procs):
            if r != victim:
                p.join(max(1.0, died + PG_TIMEOUT + EXIT_SLACK - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
    records = {}
    for r in range(world):
        f = root / f"rank{r}.json"
        records[r] = json.loads(f.read_text()) if f.exists() else None
    return codes, hung, records


def _check_good(rank, world, scenario):
    root = Path(os.environ[ROOT]) / scenario
    _, _, name = SCENARIOS[scenario]
    expected = torch.load(root / "good-expected.pt", weights_only=True)
    model = _model()
    opt = _opt(name, model)
    checkpoint.load(root / "good", opt, model)
    got = opt.state_dict()
    for pid, entry in expected["opt"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(got["state"][pid][k], v), f"{scenario}: state {pid} {k}"
    for k, v in expected["model"].items():
        assert torch.equal(model.state_dict()[k], v), f"{scenario}: model {k}"
    assert "integrity: OK" in checkpoint.inspect(root / "good")
    if scenario.startswith("mid_save"):
        assert not (root / "next" / fmt.METADATA).exists()
        with pytest.raises(CheckpointError, match="incomplete"):
            checkpoint.load(root / "next", _opt(name, _model()))


def _verifier(scenario):
    def case(rank, world):
        _check_good(rank, world, scenario)

    case.__name__ = case.__qualname__ = f"good_checkpoint_after_{scenario}"
    return case


for _s in SCENARIOS:  # module-level: the spawned ranks find the cases by name
    globals()[f"good_checkpoint_after_{_s}"] = _verifier(_s)


def _run(scenarios):
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for s in scenarios:
            (Path(tmp) / s).mkdir()
            out[s] = _spawn(s, Path(tmp) / s)
        os.environ[ROOT] = tmp
        try:
            checks = run_cases(
                [globals()[f"good_checkpoint_after_{s}"] for s in scenarios],
                2,
                timeout=240.0,
                pg_timeout=PG_TIMEOUT,
                report_hangs=True,
            )
        finally:
            os.environ.pop(ROOT, None)
        return {s: (out[s], checks[f"good_checkpoint_after_{s}"]) for s in scenarios}


@pytest.fixture(scope="module")
def fast_results():
    return _run(FAST)


@pytest.fixture(scope="module")
def slow_results():
    return _run([s for s in SCENARIOS if s not in FAST])


def _assert_scenario(scenario, result):
    (codes, hung, records), check = result
    victim, world, _ = SCENARIOS[scenario]
    assert codes[victim] == -signal.SIGKILL, f"{scenario}: the victim exited with {codes[victim]}"
    survivors = [r for r in range(world) if r != victim]
    for r in survivors:
        rec = records[r]
        if r in hung:
            where = "after raising " + rec["outcome"] if rec else "in the interrupted operation"
            pytest.fail(
                f"{scenario}: rank {r} still alive {PG_TIMEOUT + EXIT_SLACK:.0f}s after rank "
                f"{victim} died ({where}); exit codes {codes}"
            )
        assert rec is not None, f"{scenario}: rank {r} exited with {codes[r]} without reporting"
        assert rec["outcome"] != "completed", (
            f"{scenario}: rank {r} finished the operation although rank {victim} died in it"
        )
        assert rec["elapsed"] < PG_TIMEOUT + EXIT_SLACK, rec
    assert check is None, f"{scenario}: the good checkpoint after the crash:\n{check}"


@pytest.mark.parametrize("scenario", FAST)
def test_rank_killed(fast_results, scenario):
    _assert_scenario(scenario, fast_results[scenario])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s not in FAST])
def test_rank_killed_long(slow_results, scenario):
    _assert_scenario(scenario, slow_results[scenario])


# -- a collective call made on one rank only: the job ends in seconds, not at the timeout ---------

ONE_RANK_PG_TIMEOUT = 300.0  # far above what the test allows: ending must not come from it
ARRIVAL_S = 3.0


def _one_rank_worker(rank, world, store_path, root, call):
    """Rank 0 calls ``call`` alone, as a migrating DDP script does under ``if rank == 0``, and
    exits on its error as a script would; the others train on."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["SHARDOPT_ARRIVAL_TIMEOUT"] = str(ARRIVAL_S)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=ONE_RANK_PG_TIMEOUT),
    )
    model = _model()
    opt = _opt("Adam", model)
    _train_step(model, opt, 0, rank, world)
    dist.barrier()
    record = {"rank": rank}
    start = time.monotonic()
    try:
        if rank == 0:
            if call == "state_dict":
                opt.state_dict()
            else:
                checkpoint.save(Path(root) / "ckpt", opt, model)
        else:
            for s in range(1, 4):
                _train_step(model, opt, s, rank, world)
        record["outcome"] = "completed"
    except Exception as e:
        record["outcome"] = f"{type(e).__name__}: {e}"[:600]
    record["elapsed"] = time.monotonic() - start
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(record))
    # exit as a failed script does (no destroy_process_group)


@pytest.mark.parametrize("call, world", [("state_dict", 2), ("state_dict", 3), ("save", 2)])
def test_collective_call_on_one_rank_ends_the_job(call, world):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_one_rank_worker, args=(r, world, store, tmp, call))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120.0
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        records = {}
        for r in range(world):
            f = Path(tmp) / f"rank{r}.json"
            records[r] = json.loads(f.read_text()) if f.exists() else None
    assert not hung, f"ranks {hung} still running 120 s later: {records}"
    first = records[0]
    assert first is not None, records
    name = "DistributedFusedAdam.state_dict()" if call == "state_dict" else "checkpoint.save()"
    assert "CollectiveCallError" in first["outcome"] and name in first["outcome"], first
    assert "is collective" in first["outcome"], first
    assert first["elapsed"] < ARRIVAL_S + 3.0, first
    for r in range(1, world):  # they fail when rank 0 exits (its connections close)
        assert records[r] is not None and records[r]["outcome"] != "completed", records
        assert records[r]["elapsed"] < 60.0, records
