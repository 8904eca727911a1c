"""What saves leave behind: cleaned by the next save into the directory, never too early.

A save killed part-way (a rank SIGKILLed after writing its file) leaves pending files; the next
save into that directory removes them once it is complete. ``save(overwrite=True)`` at another
world size removes the replaced checkpoint's rank files (and a ``model.pt`` the new one does not
have), again only after the new checkpoint is complete: an overwrite that fails leaves the old
checkpoint whole and loadable. Files that are not a checkpoint's are never touched. A full disk
is a CheckpointError that names the disk (ENOSPC), not torch's zip-writer message.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from dist_harness import run_cases

import shardopt
from shardopt import checkpoint
from shardopt.checkpoint import format as fmt
from shardopt.checkpoint.format import CheckpointError

ROOT = "SHARDOPT_TEST_CKPT_CLEANUP_ROOT"


def _root() -> Path:
    return Path(os.environ[ROOT])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))


def _trained(rank: int, steps: int = 1):
    model = _model()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.05, bucket_cap_mb=64 * 4 / 2**20)
    for s in range(steps):
        torch.manual_seed(10 * s + rank)
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def _loads_as(path: Path, model, opt) -> None:
    """``path`` loads into a fresh optimizer with the state of ``opt`` and weights of ``model``."""
    fresh_model = _model(1)
    fresh = shardopt.DistributedFusedAdam(fresh_model.parameters(), lr=0.0, bucket_cap_mb=1.0)
    checkpoint.load(path, fresh, fresh_model)
    for a, b in zip(fresh_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want, got = opt.state_dict(), fresh.state_dict()
    for i, entry in want["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)


def save_w3(rank, world):
    model, opt = _trained(rank)
    checkpoint.save(_root() / "over", opt, model)
    if rank == 0:
        (_root() / "over" / "notes.txt").write_text("mine")  # not a checkpoint file
        (_root() / "over" / "rank7.pt").write_text("mine")


def overwrite_fails_then_succeeds(rank, world):
    """At world 2 over world 3's checkpoint: a failing overwrite keeps it, a good one replaces
    it and removes its rank files and model.pt."""
    path = _root() / "over"
    old = _names(path)
    assert "rank00002-of-00003.pt" in old and "model.pt" in old
    model, opt = _trained(rank, steps=2)
    if rank == world - 1:
        opt.param_groups[0]["note"] = object()  # no JSON form: the save fails on this rank
    with pytest.raises(CheckpointError, match="cannot be stored"):
        checkpoint.save(path, opt, model, overwrite=True)
    dist.barrier()
    assert _names(path) == old  # the old checkpoint, whole
    old_model = _model(1)
    old_opt = shardopt.DistributedFusedAdam(old_model.parameters(), lr=0.0)
    checkpoint.load(path, old_opt, old_model)
    assert int(old_opt.param_groups[0]["step"].item()) == 1
    opt.param_groups[0].pop("note", None)
    checkpoint.save(path, opt, overwrite=True)  # no model this time
    dist.barrier()
    expected = {f"rank{r:05d}-of-{world:05d}.pt" for r in range(world)}
    assert _names(path) == expected | {"metadata.json", "notes.txt", "rank7.pt"}, _names(path)
    _loads_as(path, model, opt)


def overwrite_at_world_1(rank, world):
    path = _root() / "over"
    model, opt = _trained(rank, steps=3)
    checkpoint.save(path, opt, model, overwrite=True)
    assert _names(path) == {
        "rank00000-of-00001.pt", "model.pt", "metadata.json", "notes.txt", "rank7.pt"
    }  # fmt: skip
    _loads_as(path, model, opt)


def user_model_file_kept(rank, world):
    """A model.pt no checkpoint listed is the user's: a save without a model keeps it."""
    path = _root() / "users"
    path.mkdir()
    (path / "model.pt").write_text("mine")
    model, opt = _trained(rank)
    checkpoint.save(path, opt)
    assert (path / "model.pt").read_text() == "mine"
    assert _names(path) == {"rank00000-of-00001.pt", "metadata.json", "model.pt"}
    _loads_as(path, model, opt)


def save_after_killed_save(rank, world):
    """At world 3 into the directory a killed world-2 save left (pending files, no metadata)."""
    path = _root() / "killed"
    left = _names(path)
    assert "metadata.json" not in left and any(n.endswith(".pending") for n in left), left
    model, opt = _trained(rank, steps=2)
    checkpoint.save(path, opt, model)  # no overwrite needed: nothing was published there
    dist.barrier()
    expected = {f"rank{r:05d}-of-{world:05d}.pt" for r in range(world)}
    assert _names(path) == expected | {"metadata.json", "model.pt"}, _names(path)
    _loads_as(path, model, opt)


def _killed_worker(rank, world, store_path, root):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    os.environ[ROOT] = root
    model, opt = _trained(rank)
    os.environ["SHARDOPT_CKPT_KILL_RANK"] = "1"
    checkpoint.save(Path(root) / "killed", opt, model)  # rank 1 dies in here
    os._exit(0)


def _kill_a_save(root: str) -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_killed_worker, args=(r, 2, store, root)) for r in range(2)
        ]  # fmt: skip
        for p in procs:
            p.start()
        procs[1].join(120)
        procs[0].join(5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert procs[1].exitcode == -9


def test_leftovers_are_cleaned_by_the_next_save(tmp_path):
    os.environ[ROOT] = str(tmp_path)
    try:
        _kill_a_save(str(tmp_path))
        results = run_cases([save_w3, save_after_killed_save], 3)
        results.update(run_cases([overwrite_fails_then_succeeds], 2))
        results.update(run_cases([overwrite_at_world_1, user_model_file_kept], 1))
    finally:
        os.environ.pop(ROOT, None)
    for name, err in results.items():
        assert err is None, f"{name}: {err}"


# -- a full disk ------------------------------------------------------------------------------


class _FullDisk:
    """A file whose device fills up after ``room`` bytes (what write(2) reports then)."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_full_disk_names_the_disk(tmp_path):
    """torch.save's zip writer turns ENOSPC into "enforce fail at inline_container.cc"; the
    checkpoint error names the disk instead, and no temporary file stays."""
    target = tmp_path / "rank00000-of-00001.pt"
    payload = {"fragments": [{"exp_avg": torch.zeros(100_000)}]}
    with pytest.raises(CheckpointError, match=r"no space left on the disk of .* \(ENOSPC, \d+ "):
        fmt.atomic_write(target, lambda f: torch.save(payload, _FullDisk(f, 4096)))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match=r"cannot write: "):
        fmt.atomic_write(tmp_path / "missing" / "x.pt", lambda f: f.write(b"x"))


def full_disk_save(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(64, 256)  # Adam state of ~200 KiB: more than the disk holds
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.05)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    path = _root() / "ckpt"
    with pytest.raises(CheckpointError, match=r"no space left on the disk of .*ENOSPC") as info:
        checkpoint.save(path, opt, model)
    assert "inline_container" not in str(info.value)
    dist.barrier()
    assert not (path / "metadata.json").exists()
    assert [n for n in _names(path) if n.startswith(".")] == []  # nothing of it left


def test_full_disk_during_a_real_save():
    """A real full file system (a 64 KiB tmpfs; needs the right to mount one)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", tmp], check=False)
        if done.returncode != 0:
            pytest.skip(
                "mounting a small tmpfs needs root; test_full_disk_names_the_disk covers it"
            )
        os.environ[ROOT] = tmp
        try:
            big = run_cases([full_disk_save], 3)
        finally:
            os.environ.pop(ROOT, None)
            subprocess.run(["umount", tmp], check=False)
    assert big["full_disk_save"] is None, big["full_disk_save"]
