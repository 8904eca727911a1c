"""The offline tools: consolidation keeps each param's own step, and bad input is one error line.

Consolidation: a param unused for a step is skipped (its own step stays behind the group's);
the consolidated state dict (``consolidated_state_dict`` and the CLI's ``consolidate``) gives
each param its own step, so torch.optim.AdamW continuing from it equals the DistributedFusedAdam
that continued from the checkpoint (saved at worlds 2 and 3).

The CLI: each kind of bad input (binary or non-object metadata, a non-integer version, a
malformed ``files`` entry, an unknown dtype, a non-list shape, consolidating onto a directory or
an unwritable path) gives ``error: ...`` on stderr and exit status 2, no traceback; ``load`` at
world 1 raises a CheckpointError naming the same entry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases
from dist_plan import plan_fixture

import shardopt
from shardopt import checkpoint
from shardopt.checkpoint import metadata as meta
from shardopt.checkpoint.format import CheckpointError

ROOT = "SHARDOPT_TEST_CKPT_OFFLINE_ROOT"
TOL = dict(rtol=1.3e-6, atol=1e-5)
GLOBAL_MICRO = 6  # micro-batches per step, split over ranks: lcm(1, 2, 3)
HP = dict(lr=1e-2, weight_decay=0.01)
USES_C = (True, False, True)  # step 1 leaves ``c`` unused: its own step falls behind


def _root() -> Path:
    return Path(os.environ[ROOT])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x, use_c: bool):
        h = self.b(torch.tanh(self.a(x)))
        return h + self.c(h) if use_c else h


def _micro_batches(step: int, rank: int, world: int):
    per = GLOBAL_MICRO // world
    for k in range(per):
        gen = torch.Generator().manual_seed(step * 100 + rank * per + k)
        yield torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)


def _loss(model, x, y, step):
    return nn.functional.mse_loss(model(x, USES_C[step]), y) / GLOBAL_MICRO


def _save(rank, world):
    model = Net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), bucket_cap_mb=64 * 4 / 2**20, **HP)
    for step in range(3):
        if step == 2:
            checkpoint.save(_root() / f"w{world}", opt, model)
        batches = list(_micro_batches(step, rank, world))
        for k, (x, y) in enumerate(batches):
            with torch.enable_grad() if k == len(batches) - 1 else opt.no_sync():
                (_loss(model, x, y, step) * world).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save(model.state_dict(), _root() / f"w{world}-final.pt")
    dist.barrier()


def save_w2(rank, world):
    _save(rank, world)


def save_w3(rank, world):
    _save(rank, world)


_saves = plan_fixture([(2, [save_w2]), (3, [save_w3])], ROOT, name="_saves")


@pytest.fixture(scope="module")
def saved(_saves):
    """The scratch directory the world-2 and world-3 saves wrote."""
    return _saves.check_all()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardopt.checkpoint", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("world,via", [(2, "function"), (3, "cli")])
def test_consolidated_state_continues_in_adamw(saved, tmp_path, world, via):
    if via == "function":
        sd, model_sd = checkpoint.consolidated_state_dict(saved / f"w{world}")
    else:
        out = _cli("consolidate", saved / f"w{world}", tmp_path / "c.pt")
        assert out.returncode == 0, out.stderr
        sd = torch.load(tmp_path / "c.pt", weights_only=True)
        model_sd = torch.load(tmp_path / "c.model.pt", weights_only=True)
    model = Net()
    model.load_state_dict(model_sd)
    names = [n for n, _ in model.named_parameters()]
    steps = {names[i]: float(e["step"]) for i, e in sd["state"].items()}
    assert steps == {n: (1.0 if n.startswith("c.") else 2.0) for n in names}, steps
    assert all("param_steps" not in g for g in sd["param_groups"])
    adamw = torch.optim.AdamW(model.parameters(), **HP)
    adamw.load_state_dict(sd)
    for x, y in _micro_batches(2, 0, 1):
        _loss(model, x, y, 2).backward()
    adamw.step()
    expected = torch.load(saved / f"w{world}-final.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


# -- bad input --------------------------------------------------------------------------------


def _v1(m: dict) -> dict:
    """Version 1 (no checksum): the malformed entry itself is what the checks must name."""
    m = {k: v for k, v in m.items() if k != meta.CHECKSUM}
    m["version"] = 1
    return m


def _edit(path: Path, fn) -> None:
    m = json.loads((path / meta.METADATA).read_text())
    text = fn(m)
    (path / meta.METADATA).write_bytes(
        text if isinstance(text, bytes) else json.dumps(text).encode()
    )


def _first_file(m: dict) -> str:
    return sorted(m["files"])[0]


BAD_METADATA = {
    "binary": (lambda m: b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "unreadable metadata"),
    "not an object": (lambda m: [m], "not a JSON object but a list"),
    "version": (lambda m: {**m, "version": "2"}, "'version' must be an integer"),
    "files entry": (
        lambda m: {**_v1(m), "files": {**m["files"], _first_file(m): "abc"}},
        "files entry",
    ),
    "dtype": (
        lambda m: {**_v1(m), "params": [{**m["params"][0], "dtype": "float8"}, *m["params"][1:]]},
        "unknown dtype 'float8'",
    ),
    "shape": (
        lambda m: {**_v1(m), "params": [{**m["params"][0], "shape": 16}, *m["params"][1:]]},
        "shape must be a list",
    ),
}


def _bad_copies(saved: Path, dst: Path) -> dict[str, Path]:
    out = {}
    for i, (name, (fn, _)) in enumerate(BAD_METADATA.items()):
        out[name] = dst / f"bad{i}"
        shutil.copytree(saved / "w2", out[name])
        _edit(out[name], fn)
    return out


def test_cli_bad_input_is_one_error_line(saved, tmp_path):
    for name, path in _bad_copies(saved, tmp_path).items():
        message = BAD_METADATA[name][1]
        for command in (["inspect", path], ["consolidate", path, tmp_path / "out.pt"]):
            out = _cli(*command)
            assert out.returncode == 2, (name, command[0], out.stderr)
            assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr
            assert message in out.stderr, (name, out.stderr)
            assert out.stdout == ""
    # the output path: a directory, a path that cannot be created
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for dst, message in [
        (tmp_path / "adir", "is a directory"),
        (tmp_path / "afile" / "out.pt", "cannot create the directory"),
    ]:
        out = _cli("consolidate", saved / "w2", dst)
        assert out.returncode == 2 and out.stderr.startswith("error: "), out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert _cli("inspect", tmp_path / "nowhere").returncode == 2


def load_bad_metadata(rank, world):
    for name, (_, message) in BAD_METADATA.items():
        path = Path(os.environ["SHARDOPT_TEST_CKPT_BAD"]) / name
        model = Net()
        opt = shardopt.DistributedFusedAdam(model.parameters(), **HP)
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(path, opt, model)


def test_load_names_the_bad_entry(saved, tmp_path):
    paths = _bad_copies(saved, tmp_path)
    for name, path in paths.items():
        path.rename(tmp_path / name)
    os.environ["SHARDOPT_TEST_CKPT_BAD"] = str(tmp_path)
    try:
        err = run_cases([load_bad_metadata], 1)["load_bad_metadata"]
    finally:
        os.environ.pop("SHARDOPT_TEST_CKPT_BAD", None)
    assert err is None, err


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_consolidate_refuses_output_inside_the_checkpoint(saved, tmp_path):
    """An output path that is, or resolves (symlinks followed) to, a file inside the checkpoint
    being read is refused with one error line and exit status 2, and the checkpoint is left
    byte for byte as it was (before: metadata.json or a rank file overwritten, exit 0)."""
    ck = tmp_path / "ck"
    shutil.copytree(saved / "w2", ck)
    before = _snapshot(ck)
    rank_file = next(n for n in before if n.startswith("rank"))
    (tmp_path / "link-to-metadata.pt").symlink_to(ck / meta.METADATA)
    (tmp_path / "ck-link").symlink_to(ck)
    (tmp_path / "elsewhere.model.pt").symlink_to(ck / "model.pt")  # the model's companion file
    outputs = [
        ck / meta.METADATA,
        ck / rank_file,
        ck / "consolidated.pt",
        ck / "sub" / "consolidated.pt",
        tmp_path / "link-to-metadata.pt",
        tmp_path / "ck-link" / meta.METADATA,
        tmp_path / "elsewhere.pt",
    ]
    for out in outputs:
        res = _cli("consolidate", ck, out)
        assert res.returncode == 2, (out, res.returncode, res.stderr)
        assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr, res.stderr
        assert "inside the checkpoint" in res.stderr, res.stderr
        assert _snapshot(ck) == before, out
        with pytest.raises(CheckpointError, match="inside the checkpoint"):
            checkpoint.consolidate(ck, out)
        assert _snapshot(ck) == before, out
    # beside the checkpoint is fine, and the checkpoint still loads as before
    res = _cli("consolidate", ck, tmp_path / "ck.pt")
    assert res.returncode == 0, res.stderr
    assert _snapshot(ck) == before
    sd, _ = checkpoint.consolidated_state_dict(ck)
    torch.testing.assert_close(torch.load(tmp_path / "ck.pt", weights_only=True), sd)


def test_unreadable_links_are_not_called_missing(saved, tmp_path):
    """A metadata.json (or rank file, or checkpoint directory) that is a symlink loop or a dangling
    symlink is reported as such, not as missing (the save interrupted): one error line, exit 2."""
    cases = {}
    loop = tmp_path / "loop-meta"
    shutil.copytree(saved / "w2", loop)
    (loop / meta.METADATA).unlink()
    (loop / meta.METADATA).symlink_to(loop / "other.json")
    (loop / "other.json").symlink_to(loop / meta.METADATA)
    cases[loop] = ("symlink loop", "incomplete checkpoint")
    dangling = tmp_path / "dangling-meta"
    shutil.copytree(saved / "w2", dangling)
    (dangling / meta.METADATA).unlink()
    (dangling / meta.METADATA).symlink_to(tmp_path / "gone.json")
    cases[dangling] = ("dangling symlink", "incomplete checkpoint")
    rank = tmp_path / "loop-rank"
    shutil.copytree(saved / "w2", rank)
    name = next(p.name for p in rank.iterdir() if p.name.startswith("rank"))
    (rank / name).unlink()
    (rank / name).symlink_to(rank / name)
    cases[rank] = ("symlink loop", "missing file")
    (tmp_path / "loop-dir").symlink_to(tmp_path / "loop-dir")
    cases[tmp_path / "loop-dir"] = ("symlink loop", "no such checkpoint directory")
    for path, (message, wrong) in cases.items():
        for command in (["inspect", path], ["consolidate", path, tmp_path / "out.pt"]):
            if command[0] == "inspect" and path == rank:
                out = _cli(*command)  # inspect lists the damaged file and exits 1
                assert out.returncode == 1 and message in out.stdout, out.stdout
                assert wrong not in out.stdout, out.stdout
                continue
            out = _cli(*command)
            assert out.returncode == 2, (path.name, command[0], out.stderr)
            assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
            assert message in out.stderr and wrong not in out.stderr, (path.name, out.stderr)
        with pytest.raises(CheckpointError, match=message):
            checkpoint.consolidated_state_dict(path)
