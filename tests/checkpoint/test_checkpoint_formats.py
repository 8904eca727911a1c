"""``state_dict()``, the sharded checkpoint files and DCP save the same state, in every storage.

For fp32 and bf16 params with every master kind (copy, remainders, the params' own) and every
state format, a run at worlds 2 and 3 (a param skipped for one step, so its own step is behind)
is saved three ways: ``optimizer.state_dict()``, ``shardopt.checkpoint.save`` (read back with
``consolidated_state_dict``) and DCP (read back with ``dcp_to_torch_save``). Every value all of
them hold is identical (moments, masters, each param's own step, the group hyperparameters).
The key sets differ in one documented place: ``state_dict()`` holds no ``master_param`` for
16-bit params that are their own masters (``dtype=torch.bfloat16``), where the files and DCP
hold the params' values, so that a load without the model restores the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_plan import plan_fixture

import shardopt
from shardopt import checkpoint

ROOT = "SHARDOPT_TEST_CKPT_FORMATS_ROOT"
MASTER = "master_param"

# name -> (param dtype, optimizer keywords)
STORAGES = {
    "fp32": (torch.float32, {}),
    "fp32-bf16": (torch.float32, {"state_format": "bf16"}),
    "fp32-fp16": (torch.float32, {"state_format": "fp16"}),
    "fp32-scaled_fp16": (torch.float32, {"state_format": "scaled_fp16"}),
    "fp32-int8": (torch.float32, {"state_format": "int8"}),
    "bf16-copy": (torch.bfloat16, {}),
    "bf16-remainders": (torch.bfloat16, {"store_param_remainders": True}),
    "bf16-remainders-int8": (
        torch.bfloat16,
        {"store_param_remainders": True, "state_format": "int8"},
    ),
    "bf16-own-state": (torch.bfloat16, {"dtype": torch.bfloat16}),
}


def _root() -> Path:
    return Path(os.environ[ROOT])


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 40)
        self.b = nn.Linear(40, 6)
        self.c = nn.Linear(6, 6)  # unused at step 1
        self.to(dtype)

    def forward(self, x, use_c):
        h = self.b(torch.tanh(self.a(x)))
        return h + self.c(h) if use_c else h


def _save_three_ways(rank, world):
    import torch.distributed.checkpoint as dcp

    for name, (dtype, kwargs) in STORAGES.items():
        model = Net(dtype)
        opt = shardopt.DistributedFusedAdam(
            model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=200 * 4 / 2**20, **kwargs
        )
        for step in range(2):
            torch.manual_seed(step * 10 + rank)
            model(torch.randn(4, 6).to(dtype), step == 0).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        checkpoint.save(_root() / f"{name}-w{world}", opt)
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=_root() / f"{name}-d{world}")
        if rank == 0:
            torch.save(sd, _root() / f"{name}-w{world}-sd.pt")
        dist.barrier()


def save_w2(rank, world):
    _save_three_ways(rank, world)


def save_w3(rank, world):
    _save_three_ways(rank, world)


_saves = plan_fixture([(2, [save_w2]), (3, [save_w3])], ROOT, name="_saves")


@pytest.fixture(scope="module")
def saved(_saves):
    """The scratch directory the world-2 and world-3 saves wrote."""
    return _saves.check_all()


def _dcp_state(path: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp / "dcp.pt")
    optim = torch.load(tmp / "dcp.pt", weights_only=True)["optim"]
    groups = optim["param_groups"]
    state = {int(k): v for k, v in optim["state"].items()}  # keyed by param index (no model)
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(STORAGES))
def test_same_state_three_ways(saved, tmp_path, name, world):
    dtype, kwargs = STORAGES[name]
    own_master = dtype != torch.float32 and kwargs.get("dtype") == dtype
    sd = torch.load(saved / f"{name}-w{world}-sd.pt", weights_only=True)
    files, _ = checkpoint.consolidated_state_dict(saved / f"{name}-w{world}")
    dcp_sd = _dcp_state(saved / f"{name}-d{world}", tmp_path)
    assert set(sd["state"]) == set(files["state"]) == set(dcp_sd["state"])
    for i, entry in sd["state"].items():
        f, d = files["state"][i], dcp_sd["state"][i]
        assert set(f) == set(d), (i, set(f), set(d))
        extra = {MASTER} if own_master else set()
        assert set(f) == set(entry) | extra, (i, set(f), set(entry))
        for key in set(f):
            want = entry.get(key, f[key])
            for where, got in (("files", f[key]), ("dcp", d[key])):
                torch.testing.assert_close(
                    got.float().reshape(want.shape),
                    want.float(),
                    rtol=0,
                    atol=0,
                    msg=lambda m, i=i, k=key, w=where: f"{name} param {i} {k} ({w}): {m}",
                )
    # each param's own step: ``c`` (params 4, 5) was skipped once
    assert [float(sd["state"][i]["step"]) for i in sorted(sd["state"])] == [2, 2, 2, 2, 1, 1]
    for groups in (files["param_groups"], dcp_sd["param_groups"]):
        for g, want in zip(groups, sd["param_groups"]):
            for k in ("lr", "weight_decay", "eps", "step"):
                assert g[k] == want[k], (k, g[k], want[k])
            assert tuple(g["betas"]) == tuple(want["betas"])
