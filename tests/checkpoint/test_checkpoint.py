"""Sharded checkpoints on gloo: reshard across world sizes and bucket sizes, consolidation and
import, bad input with clear errors, and a rank SIGKILLed in the middle of a save."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from dist_harness import run_cases
from dist_plan import plan_fixture, plan_params

import shardopt
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError

TOL = dict(rtol=1.3e-6, atol=1e-5)
GLOBAL_MICRO = 12  # micro-batches per step, split over ranks: lcm(1, 2, 3, 4)
ALGOS = ("Adam", "LAMB", "NovoGrad")
ROOT = "SHARDOPT_TEST_CKPT_ROOT"


def _root() -> Path:
    return Path(os.environ[ROOT])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))


def _step(model, opt, step, rank, world):
    """One optimizer step on a world-size independent global batch (GLOBAL_MICRO micro-batches;
    each rank accumulates its share with no_sync, losses scaled so the average is the mean)."""
    per = GLOBAL_MICRO // world
    for k in range(per):
        gen = torch.Generator().manual_seed(step * 100 + rank * per + k)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
        loss = nn.functional.mse_loss(model(x), y) * world / GLOBAL_MICRO
        with torch.enable_grad() if k == per - 1 else opt.no_sync():
            loss.backward()
    opt.step()


def _opt(name, model, bucket_mb):
    cls = getattr(shardopt, f"DistributedFused{name}")
    return cls(model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=bucket_mb)


def _save_then_continue(rank, world):
    for name in ALGOS:
        model = _model()
        opt = _opt(name, model, 64 * 4 / 2**20)
        for s in range(2):
            _step(model, opt, s, rank, world)
        checkpoint.save(_root() / f"{name}-w{world}", opt, model)
        for s in range(2, 4):
            _step(model, opt, s, rank, world)
        if rank == 0:
            torch.save(model.state_dict(), _root() / f"{name}-w{world}-final.pt")
        dist.barrier()


def save_w2(rank, world):
    _save_then_continue(rank, world)


def save_w3(rank, world):
    _save_then_continue(rank, world)


def save_w4(rank, world):
    _save_then_continue(rank, world)


def _resume(rank, world, saved_world):
    for name in ALGOS:
        torch.manual_seed(123)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))  # other init
        opt = _opt(name, model, 1.0)  # other bucket size
        checkpoint.load(_root() / f"{name}-w{saved_world}", opt, model)
        assert int(opt.param_groups[0]["step"].item()) == 2
        for s in range(2, 4):
            _step(model, opt, s, rank, world)
        expected = torch.load(_root() / f"{name}-w{saved_world}-final.pt", weights_only=True)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(
                v, expected[k], **TOL, msg=lambda m, k=k, n=name: f"{n} {k}: {m}"
            )


def resume_from_w2(rank, world):
    _resume(rank, world, 2)


def resume_from_w3(rank, world):
    _resume(rank, world, 3)


def resume_from_w4(rank, world):
    _resume(rank, world, 4)


def consolidate_adamw_round_trip(rank, world):
    sd, model_sd = checkpoint.consolidated_state_dict(_root() / "Adam-w2")
    model = _model()
    model.load_state_dict(model_sd)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    adamw.load_state_dict(sd)
    opt = _opt("Adam", model, 64 * 4 / 2**20)
    opt.load_state_dict(adamw.state_dict())
    back = opt.state_dict()
    for i, entry in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(back["state"][i][k], entry[k], rtol=0, atol=0)
    assert back["param_groups"][0]["step"] == 2


def bad_inputs(rank, world):
    src = _root() / "Adam-w2"
    model = _model()
    opt = _opt("Adam", model, 64 * 4 / 2**20)
    _step(model, opt, 0, rank, world)
    before = opt.state_dict()
    work = _root() / f"bad-{world}"

    def fresh():
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(src, work)
        dist.barrier()

    def damage(fn):
        fresh()
        if rank == 0:
            fn()
        dist.barrier()

    rank_file = work / "rank00001-of-00002.pt"
    cases = [
        (lambda: os.truncate(rank_file, rank_file.stat().st_size // 2), "truncated"),
        (lambda: _flip_byte(rank_file), "checksum mismatch"),
        (lambda: rank_file.unlink(), "missing file"),
        (lambda: (work / "metadata.json").unlink(), "incomplete"),
        (lambda: _edit_metadata(work, version=99), "newer"),
    ]
    for fn, message in cases:
        damage(fn)
        with pytest.raises(CheckpointError, match=message) as info:
            checkpoint.load(work, opt, model)
        if message != "incomplete":
            assert str(work) in str(info.value)
    # metadata of another model: the mismatched params are listed
    fresh()
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    other_opt = _opt("Adam", other, 1.0)
    with pytest.raises(CheckpointError, match=r"another model: .*param 0 '0.weight'"):
        checkpoint.load(work, other_opt, other)
    # nothing changed by the failed loads
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(after["state"][i][k], v, rtol=0, atol=0)
    # saving over a complete checkpoint needs overwrite=True
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        checkpoint.save(work, opt)
    checkpoint.save(work, opt, overwrite=True)
    checkpoint.load(work, opt)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_metadata(directory: Path, **changes) -> None:
    import json

    meta = json.loads((directory / "metadata.json").read_text())
    meta.update(changes)
    (directory / "metadata.json").write_text(json.dumps(meta))


# One process launch per entry, in order (saves before the resumes that read them).
PLAN = [
    (2, [save_w2]),
    (3, [save_w3, resume_from_w2]),
    (4, [save_w4, resume_from_w2]),
    (1, [resume_from_w2]),
    (2, [resume_from_w3, resume_from_w4, consolidate_adamw_round_trip, bad_inputs]),
]


results = plan_fixture(PLAN, ROOT)


@pytest.fixture(scope="module")
def root(results):
    return results.root


@plan_params(PLAN)
def test_checkpoint(results, world, case):
    results.check(world, case)


def test_cli_inspect_and_consolidate(root, tmp_path):
    run = [sys.executable, "-m", "shardopt.checkpoint"]
    out = subprocess.run(run + ["inspect", str(root / "LAMB-w3")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "DistributedFusedLAMB at world size 3" in out.stdout and "integrity: OK" in out.stdout
    dst = tmp_path / "adam.pt"
    out = subprocess.run(
        run + ["consolidate", str(root / "Adam-w2"), str(dst)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    sd = torch.load(dst, weights_only=True)
    model = _model()
    model.load_state_dict(torch.load(tmp_path / "adam.model.pt", weights_only=True))
    single = shardopt.FusedAdam(model.parameters(), lr=0.05, weight_decay=0.01)
    single.load_state_dict(sd)
    assert single.param_groups[0]["step"] == 2
    broken = tmp_path / "broken"
    shutil.copytree(root / "Adam-w2", broken)
    _flip_byte(broken / "rank00000-of-00002.pt")
    out = subprocess.run(run + ["inspect", str(broken)], capture_output=True, text=True)
    assert out.returncode == 1 and "checksum mismatch" in out.stdout


# -- crash safety: a rank SIGKILLed in the middle of a save ----------------------------------------


def _crash_worker(rank, world, store_path, root, kill):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    os.environ[ROOT] = root
    model = _model()
    opt = _opt("Adam", model, 64 * 4 / 2**20)
    for s in range(2):
        _step(model, opt, s, rank, world)
    checkpoint.save(Path(root) / "step2", opt, model)
    _step(model, opt, 2, rank, world)
    if kill:
        os.environ["SHARDOPT_CKPT_KILL_RANK"] = "1"
        checkpoint.save(Path(root) / "step3", opt, model)  # rank 1 dies in here
    else:
        _step(model, opt, 3, rank, world)
        if rank == 0:
            torch.save(model.state_dict(), Path(root) / "uninterrupted.pt")
        dist.barrier()  # no rank tears gloo down under the other
    dist.destroy_process_group()
    # skip interpreter teardown: gloo's threads can abort the process there on a loaded machine
    # (SIGABRT after every result is on disk), which is not what this test checks
    os._exit(0)


def resume_after_crash(rank, world):
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.load(_root() / "step3", _opt("Adam", _model(), 1.0))
    model = _model()
    opt = _opt("Adam", model, 1.0)
    checkpoint.load(_root() / "step2", opt, model)
    for s in range(2, 4):
        _step(model, opt, s, rank, world)
    expected = torch.load(_root() / "uninterrupted.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], **TOL)


def _spawn(root: str, kill: bool) -> list[int | None]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_crash_worker, args=(r, 2, store, root, kill)) for r in range(2)
        ]
        for p in procs:
            p.start()
        procs[1].join(120)
        procs[0].join(5 if kill else 120)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return [p.exitcode for p in procs]


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    assert _spawn(root, kill=False) == [0, 0]
    (tmp_path / "step2").rename(tmp_path / "step2-uninterrupted")
    codes = _spawn(root, kill=True)
    assert codes[1] == -9  # SIGKILL
    assert (tmp_path / "step2" / "metadata.json").exists()
    assert not (tmp_path / "step3" / "metadata.json").exists()
    os.environ[ROOT] = root
    try:
        err = run_cases([resume_after_crash], 2)["resume_after_crash"]
    finally:
        os.environ.pop(ROOT, None)
    assert err is None, err


# -- torch.distributed.checkpoint interop -------------------------------------------------------


def _dcp_run(rank, world, save):
    import torch.distributed.checkpoint as dcp

    for name in ("Adam", "NovoGrad"):
        path = str(_root() / f"dcp-{name}")
        model = _model()
        opt = _opt(name, model, 64 * 4 / 2**20 if save else 1.0)
        if save:
            for s in range(2):
                _step(model, opt, s, rank, world)
            dcp.save(
                {"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path
            )
            for s in range(2, 4):
                _step(model, opt, s, rank, world)
            if rank == 0:
                torch.save(model.state_dict(), path + "-final.pt")
            dist.barrier()
            continue
        sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        opt.load_sharded_state_dict(sd["optim"])
        assert int(opt.param_groups[0]["step"].item()) == 2
        for s in range(2, 4):
            _step(model, opt, s, rank, world)
        expected = torch.load(path + "-final.pt", weights_only=True)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, expected[k], **TOL)


def dcp_save(rank, world):
    _dcp_run(rank, world, save=True)


def dcp_load(rank, world):
    _dcp_run(rank, world, save=False)


def test_dcp_reshard_2_to_3(tmp_path):
    os.environ[ROOT] = str(tmp_path)
    try:
        assert run_cases([dcp_save], 2)["dcp_save"] is None
        err = run_cases([dcp_load], 3)["dcp_load"]
    finally:
        os.environ.pop(ROOT, None)
    assert err is None, err
