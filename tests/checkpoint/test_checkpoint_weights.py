"""A checkpoint restores the saved weights in every storage format, with or without the model.

``shardopt.checkpoint.load(path, opt)`` without ``model=`` and DCP's ``load_sharded_state_dict``
without the model's state take the masters from the checkpoint and write them into the params:
fp32 params, bf16 params with fp32 copy masters, with ``store_param_remainders=True``, with
``dtype=torch.bfloat16`` state and with compact state formats all end with the saved weights
bit for bit, the saved state, and training that continues exactly as it would have. Saved and
loaded on gloo at worlds 1-3 (and across world sizes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_plan import plan_fixture, plan_params

import shardopt
from shardopt import checkpoint

ROOT = "SHARDOPT_TEST_CKPT_WEIGHTS_ROOT"
TOL = dict(rtol=1.3e-6, atol=1e-5)
GLOBAL_MICRO = 6  # micro-batches per step, split over ranks: lcm(1, 2, 3)

# name -> (param dtype, optimizer keywords)
STORAGES = {
    "fp32": (torch.float32, {}),
    "bf16-copy": (torch.bfloat16, {}),
    "bf16-remainders": (torch.bfloat16, {"store_param_remainders": True}),
    "bf16-own-state": (torch.bfloat16, {"dtype": torch.bfloat16}),
    "bf16-remainders-int8": (
        torch.bfloat16,
        {"store_param_remainders": True, "state_format": "int8"},
    ),
    "fp32-scaled_fp16": (torch.float32, {"state_format": "scaled_fp16"}),
}


def _root() -> Path:
    return Path(os.environ[ROOT])


def _model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 6)).to(dtype)


def _opt(model: nn.Module, kwargs: dict, bucket_mb: float):
    return shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=bucket_mb, **kwargs
    )


def _step(model, opt, step, rank, world, dtype):
    per = GLOBAL_MICRO // world
    for k in range(per):
        gen = torch.Generator().manual_seed(step * 100 + rank * per + k)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y) * world / GLOBAL_MICRO
        with torch.enable_grad() if k == per - 1 else opt.no_sync():
            loss.backward()
    opt.step()
    opt.zero_grad()


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert set(got["state"]) == set(want["state"]), what
    for i, entry in want["state"].items():
        assert set(got["state"][i]) == set(entry), f"{what}: param {i}"
        for k, v in entry.items():
            torch.testing.assert_close(
                got["state"][i][k],
                v,
                rtol=0,
                atol=0,
                msg=lambda m, i=i, k=k, w=what: f"{w} {i} {k}: {m}",
            )


def _save(rank, world):
    import torch.distributed.checkpoint as dcp

    for name, (dtype, kwargs) in STORAGES.items():
        model = _model(dtype, 0)
        opt = _opt(model, kwargs, 200 * 4 / 2**20)
        for s in range(2):
            _step(model, opt, s, rank, world, dtype)
        checkpoint.save(_root() / f"{name}-w{world}", opt)  # no model: the masters hold them
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=_root() / f"{name}-dcp{world}")
        expected = {"weights": _weights(model), "state": opt.state_dict()}
        _step(model, opt, 2, rank, world, dtype)
        expected["next"] = _weights(model)
        if rank == 0:
            torch.save(expected, _root() / f"{name}-w{world}-expected.pt")
        dist.barrier()


def _load(rank, world, saved_world):
    import torch.distributed.checkpoint as dcp

    for name, (dtype, kwargs) in STORAGES.items():
        expected = torch.load(_root() / f"{name}-w{saved_world}-expected.pt", weights_only=True)
        for via in ("sharded", "dcp"):
            what = f"{name} saved at world {saved_world}, loaded via {via}"
            model = _model(dtype, 1)  # another init: every weight must come from the checkpoint
            opt = _opt(model, kwargs, 1.0)  # another bucket size
            if via == "sharded":
                checkpoint.load(_root() / f"{name}-w{saved_world}", opt)
            else:
                if dtype == torch.float32:
                    # fp32 params are their own masters: DCP's optimizer state holds no copy of
                    # them, their weights are the model's state in the same checkpoint
                    continue
                sd = {"optim": opt.sharded_state_dict()}
                dcp.load(sd, checkpoint_id=_root() / f"{name}-dcp{saved_world}")
                opt.load_sharded_state_dict(sd["optim"])
            for i, (p, w) in enumerate(zip(model.parameters(), expected["weights"])):
                torch.testing.assert_close(
                    p.detach(), w, rtol=0, atol=0, msg=lambda m, i=i, w=what: f"{w}: param {i}: {m}"
                )
            _assert_same_state(opt.state_dict(), expected["state"], what)
            _step(model, opt, 2, rank, world, dtype)
            # the same world sums the same grads in the same order: bit for bit; another
            # world size rounds the bf16 grads' sum otherwise (one bf16 ulp)
            tol = TOL if dtype == torch.float32 else dict(rtol=0, atol=0)
            if dtype != torch.float32 and world != saved_world:
                tol = dict(rtol=2**-7, atol=2**-9)
            for i, (p, w) in enumerate(zip(model.parameters(), expected["next"])):
                torch.testing.assert_close(
                    p.detach(), w, **tol, msg=lambda m, i=i, w=what: f"{w}: step 3, param {i}: {m}"
                )


def save_w1(rank, world):
    _save(rank, world)


def save_w2(rank, world):
    _save(rank, world)


def save_w3(rank, world):
    _save(rank, world)


def load_own(rank, world):
    _load(rank, world, world)


def load_from_w1(rank, world):
    _load(rank, world, 1)


def load_from_w2(rank, world):
    _load(rank, world, 2)


def load_from_w3(rank, world):
    _load(rank, world, 3)


PLAN = [
    (1, [save_w1, load_own]),
    (2, [save_w2, load_own, load_from_w1]),
    (3, [save_w3, load_own, load_from_w2]),
    (1, [load_from_w3]),
]


results = plan_fixture(PLAN, ROOT)


@plan_params(PLAN)
def test_weights_restored(results, world, case):
    results.check(world, case)
