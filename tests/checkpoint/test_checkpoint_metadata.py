"""metadata.json can be trusted: its own checksum, full coverage of the restored state, a fuzz.

A checkpoint saved at world 2 is loaded at worlds 1-3 after: a one-digit change (checksum
mismatch); a rewrite as the older format version 1 (no checksum: loads identically); a version-1
metadata with a rank file's fragment list dropped or shortened (a CheckpointError naming the
state, the param and the gap, nothing changed). Then a seeded fuzz of a few hundred random digit
flips and structural edits of metadata.json (also re-signed with a valid checksum, as a buggy
writer would) must each end in a CheckpointError raised by shardopt's checks with the optimizer
untouched, or in a load identical to the intact one; never in a partial load.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_plan import plan_fixture, plan_params

import shardopt
from shardopt import checkpoint
from shardopt.checkpoint import metadata as meta
from shardopt.checkpoint.format import CheckpointError

ROOT = "SHARDOPT_TEST_CKPT_METADATA_ROOT"
SEED = 26


def _root() -> Path:
    return Path(os.environ[ROOT])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 6))


def _opt(model, bucket_mb=1.0):
    return shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=bucket_mb
    )


def _snapshot(model, opt) -> dict:
    return {"weights": [p.detach().clone() for p in model.parameters()], "sd": opt.state_dict()}


def _same(a: dict, b: dict) -> bool:
    if any(not torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])):
        return False
    sa, sb = a["sd"], b["sd"]
    if set(sa["state"]) != set(sb["state"]) or sa["param_groups"] != sb["param_groups"]:
        return False
    for i, entry in sa["state"].items():
        if set(entry) != set(sb["state"][i]):
            return False
        if any(not torch.equal(v, sb["state"][i][k]) for k, v in entry.items()):
            return False
    return True


def save_w2(rank, world):
    model = _model(0)
    opt = _opt(model, 100 * 4 / 2**20)  # several buckets: several fragments per rank
    for s in range(2):
        torch.manual_seed(s * 10 + rank)
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(_root() / "ckpt", opt)


def _work(rank, name: str, edit) -> Path:
    """A copy of the checkpoint with ``edit(metadata dict) -> text`` applied (by rank 0)."""
    work = _root() / f"{name}-{dist.get_world_size()}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(_root() / "ckpt", work)
        text = edit(json.loads((work / meta.METADATA).read_text()))
        (work / meta.METADATA).write_bytes(text if isinstance(text, bytes) else text.encode())
    dist.barrier()
    return work


def _as_version_1(m: dict) -> dict:
    m = dict(m)
    m.pop(meta.CHECKSUM)
    m["version"] = 1
    return m


def checksum_and_old_version(rank, world):
    intact_model = _model(1)
    intact_opt = _opt(intact_model)
    checkpoint.load(_root() / "ckpt", intact_opt)
    intact = _snapshot(intact_model, intact_opt)
    text = (_root() / "ckpt" / meta.METADATA).read_text()
    assert json.loads(text)["version"] == meta.VERSION == 2

    # one digit of lr changed: refused, nothing changed
    def lr_digit(m):
        m["param_groups"][0]["lr"] = 0.06
        return json.dumps(m)

    model, opt = _model(1), None
    opt = _opt(model)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match="checksum mismatch: metadata.json was changed"):
        checkpoint.load(_work(rank, "lr", lr_digit), opt)
    assert _same(_snapshot(model, opt), before)
    # a checksum-less metadata.json claiming the current version is refused
    no_sum = _work(rank, "nosum", lambda m: json.dumps({**m, meta.CHECKSUM: None}))
    with pytest.raises(CheckpointError, match="no 'checksum'"):
        checkpoint.load(no_sum, opt)
    # format version 1 (no checksum) still loads, identically
    old = _work(rank, "v1", lambda m: json.dumps(_as_version_1(m)))
    model = _model(1)
    opt = _opt(model)
    checkpoint.load(old, opt)
    assert _same(_snapshot(model, opt), intact)
    assert "v1" in checkpoint.inspect(old).splitlines()[1]


def coverage_gaps(rank, world):
    """Version-1 metadata (no checksum to catch it) whose fragment lists do not cover the state."""
    files = sorted(json.loads((_root() / "ckpt" / meta.METADATA).read_text())["fragments"])

    def drop_file(m):
        m = _as_version_1(m)
        del m["fragments"][files[1]]  # rank 1's fragments: listed nowhere
        return json.dumps(m)

    def shorten(m):
        m = _as_version_1(m)
        m["fragments"][files[0]][0][2] -= 1  # one element less than the file holds
        return json.dumps(m)

    def drop_entry(m):
        m = _as_version_1(m)
        m["fragments"][files[0]].pop(0)
        return json.dumps(m)

    cases = [
        (drop_file, r"state '(exp_avg|exp_avg_sq|master_param)' of param \d+ '\w+': elements "
         r"\[\d+, \d+\) are in no fragment of the checkpoint"),
        (shorten, "holds other fragments than metadata.json lists"),
        (drop_entry, "holds other fragments than metadata.json lists|are in no fragment"),
    ]  # fmt: skip
    model = _model(1)
    opt = _opt(model, 100 * 4 / 2**20)
    before = _snapshot(model, opt)
    for edit, message in cases:
        work = _work(rank, edit.__name__, lambda m, e=edit: e(m))
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(work, opt)
        assert _same(_snapshot(model, opt), before), edit.__name__


# -- the fuzz ---------------------------------------------------------------------------------

_VALUES = [None, 0, -1, 1, 2**40, 0.5, "x", "", [], {}, [0], {"a": 1}, True, [0, 0, 0]]


def _paths(node, prefix=()):
    """Every (path, value) inside a parsed JSON document."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _structural(m: dict, rng: random.Random) -> tuple[dict, tuple]:
    """One random structural edit (delete, replace, duplicate, swap or add); (edited, path)."""
    path, value = rng.choice([pv for pv in _paths(m) if pv[0]])
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = rng.choice(["delete", "replace", "duplicate", "swap", "add"])
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = rng.choice([v for v in _VALUES if v != value])
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(value)))
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = rng.choice([i for i in range(len(parent)) if i != key])
        parent[key], parent[other] = parent[other], parent[key]
    elif isinstance(value, dict):
        value[f"extra{rng.randrange(9)}"] = rng.choice(_VALUES)
    else:
        parent[key] = [value]
    return m, path


def _resign(m: dict) -> dict:
    if isinstance(m, dict) and isinstance(m.get(meta.CHECKSUM), str):
        m[meta.CHECKSUM] = meta._checksum(m)
    return m


def _mutations(text: str, count: int, seed: int):
    """(kind, mutated text) for ``count`` seeded cases."""
    rng = random.Random(seed)
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    for n in range(count):
        kind = ("digit", "structural", "resigned")[n % 3]
        if kind == "digit":
            i = rng.choice(digits)
            new = rng.choice([d for d in "0123456789" if d != text[i]])
            yield kind, text[:i] + new + text[i + 1 :]
            continue
        m, path = _structural(json.loads(text), rng)
        if kind == "resigned":
            # a valid checksum over edited content: only the edits that carry no hyperparameter
            # (a re-signed lr is a legitimate, complete load of another lr)
            while path[0] in ("param_groups", meta.CHECKSUM):
                m, path = _structural(json.loads(text), rng)
            m = _resign(m)
        yield kind, json.dumps(m, indent=1)


def _fuzz(rank, world, count):
    text = (_root() / "ckpt" / meta.METADATA).read_text()
    model = _model(1)
    opt = _opt(model)
    checkpoint.load(_root() / "ckpt", opt)
    intact = _snapshot(model, opt)
    fresh_model = _model(1)
    fresh = _snapshot(fresh_model, _opt(fresh_model))
    work = _root() / f"fuzz-{world}"
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(_root() / "ckpt", work)
    outcomes = {"error": 0, "identical": 0}
    for n, (kind, mutated) in enumerate(_mutations(text, count, SEED + world)):
        dist.barrier()
        if rank == 0:
            (work / meta.METADATA).write_text(mutated)
        dist.barrier()
        model = _model(1)
        opt = _opt(model)
        try:
            checkpoint.load(work, opt)
        except CheckpointError as e:
            # raised by shardopt's checks, not a Python error wrapped on the way out
            assert re.search(r"rank \d+: CheckpointError: ", str(e)), f"case {n} ({kind}): {e}"
            assert _same(_snapshot(model, opt), fresh), f"case {n} ({kind}) changed state: {e}"
            outcomes["error"] += 1
            continue
        assert _same(_snapshot(model, opt), intact), f"case {n} ({kind}) loaded partially"
        outcomes["identical"] += 1
    assert outcomes["error"] > count // 2, outcomes  # the edits do reach the checks


def fuzz_w1(rank, world):
    _fuzz(rank, world, 300)


def fuzz_w3(rank, world):
    _fuzz(rank, world, 45)


PLAN = [
    (2, [save_w2, checksum_and_old_version, coverage_gaps]),
    (1, [checksum_and_old_version, coverage_gaps, fuzz_w1]),
    (3, [checksum_and_old_version, coverage_gaps, fuzz_w3]),
]


results = plan_fixture(PLAN, ROOT, timeout=400)


@plan_params(PLAN)
def test_metadata(results, world, case):
    results.check(world, case)


def test_validate_metadata_names_the_entry(tmp_path):
    """validate_metadata covers every type load reads (no process group needed)."""
    good = {
        "format": meta.FORMAT,
        "version": 2,
        "world_size": 1,
        "optimizer": "DistributedFusedAdam",
        "state_names": ["exp_avg"],
        "params": [{"name": "w", "shape": [2, 3], "dtype": "float32"}],
        "param_groups": [{"params": [0], "step": 1, "lr": 0.1}],
        "fragments": {"rank00000-of-00001.pt": [[0, 0, 6]]},
        "files": {"rank00000-of-00001.pt": {"sha256": "0" * 64, "bytes": 10}},
        "has_model": False,
    }
    meta.validate_metadata(good, tmp_path)
    bad = [
        ([], "not a JSON object"),
        ({**good, "version": "2"}, "'version' must be a int"),
        ({**good, "files": {"rank00000-of-00001.pt": [1]}}, "files entry"),
        ({**good, "files": {"../x.pt": {"sha256": "0" * 64, "bytes": 1}}}, "files entry"),
        ({**good, "params": [{"name": "w", "shape": [2, 3], "dtype": "int4"}]}, "unknown dtype"),
        ({**good, "params": [{"name": "w", "shape": 6, "dtype": "float32"}]}, "shape must be"),
        ({**good, "params": [{"name": "w", "shape": [-1], "dtype": "float32"}]}, "shape must be"),
        ({**good, "fragments": {"rank00000-of-00001.pt": [[0, 0, 7]]}}, "not a range"),
        ({**good, "fragments": {"rank00000-of-00001.pt": [[1, 0, 1]]}}, "not a range"),
        ({**good, "fragments": {"other.pt": [[0, 0, 6]]}}, "not listed in 'files'"),
        ({**good, "param_groups": [{"params": [3], "step": 1}]}, "params must be"),
        ({**good, "param_groups": [{"params": [0], "step": 1, "param_steps": [2]}]}, "param_st"),
        ({**good, "state_names": [1]}, "state_names"),
    ]
    for value, message in bad:
        with pytest.raises(CheckpointError, match=message):
            meta.validate_metadata(value, tmp_path)
