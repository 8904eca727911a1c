"""torch.distributed.checkpoint with DistributedFused*: DTensor sharded state dicts, torch's own
get_state_dict/set_state_dict, async_save, resharding 2 -> 3, and dcp_to_torch_save -> AdamW."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases

import shardopt
from shardopt.checkpoint import dcp as sdcp

TOL = dict(rtol=1.3e-6, atol=1e-5)
GLOBAL_MICRO = 12  # micro-batches per step, split over ranks: lcm(1, 2, 3, 4)
ROOT = "SHARDOPT_TEST_DCP_ROOT"
HP = dict(lr=0.05, weight_decay=0.01)


def _root() -> Path:
    return Path(os.environ[ROOT])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.out = nn.Linear(16, 6)
        self.gain = nn.Parameter(torch.tensor(1.5))  # a 0-dim param (Replicate)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x))) * self.gain


def _batch(step, k):
    gen = torch.Generator().manual_seed(step * 100 + k)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)


def _step(model, opt, step, rank, world):
    per = GLOBAL_MICRO // world
    for k in range(per):
        x, y = _batch(step, rank * per + k)
        loss = nn.functional.mse_loss(model(x), y) * world / GLOBAL_MICRO
        if k < per - 1:
            with opt.no_sync():
                loss.backward()
        else:
            loss.backward()
    opt.step()


def _make(cls="Adam", bucket_mb=1.0, **groups):
    model = Net()
    opt = getattr(shardopt, f"DistributedFused{cls}")(
        model.parameters(), bucket_cap_mb=bucket_mb, **groups, **HP
    )
    return model, opt


def dcp_save_hsdp(rank, world):
    """HSDP (2 shards x 2 replicas): a (replicate, shard) mesh; DCP writes each chunk once."""
    import torch.distributed.checkpoint as dcp

    from shardopt.zero import hsdp_groups

    model, opt = _make("Adam", bucket_mb=40 * 4 / 2**20, **hsdp_groups(2)._asdict())
    for s in range(2):
        _step(model, opt, s, rank, world)
    msd, osd = sdcp.get_state_dict(model, opt)
    sample = osd["state"]["inp.weight"]["exp_avg"]
    assert sample.device_mesh.ndim == 2 and tuple(sample.shape) == (16, 6)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(_root() / "hsdp-Adam"))
    for s in range(2, 4):
        _step(model, opt, s, rank, world)
    if rank == 0:
        torch.save(model.state_dict(), _root() / "final-hsdp-Adam.pt")
    dist.barrier()


def dcp_save(rank, world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for cls in ("Adam", "LAMB"):
        model, opt = _make(cls, bucket_mb=40 * 4 / 2**20)  # several buckets, params straddle
        for s in range(2):
            _step(model, opt, s, rank, world)
        msd, osd = sdcp.get_state_dict(model, opt)
        sample = osd["state"]["inp.weight"]["exp_avg"]
        assert type(sample).__name__ == "DTensor" and tuple(sample.shape) == (16, 6)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(_root() / f"sharded-{cls}"))
        # torch's own get_state_dict: the full state (no fake step, no error)
        tmsd, tosd = get_state_dict(model, opt)
        assert set(tosd["state"]) == {"inp.weight", "inp.bias", "out.weight", "out.bias", "gain"}
        dcp.save({"model": tmsd, "optim": tosd}, checkpoint_id=str(_root() / f"torch-{cls}"))
        for s in range(2, 4):
            _step(model, opt, s, rank, world)
        if rank == 0:
            torch.save(model.state_dict(), _root() / f"final-{cls}.pt")
        dist.barrier()


def dcp_load(rank, world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    sources = [(c, h) for c in ("Adam", "LAMB") for h in ("sharded", "torch", "cross")]
    for cls, how in sources + [("Adam", "hsdp")]:
        final = f"final-hsdp-{cls}.pt" if how == "hsdp" else f"final-{cls}.pt"
        expected = torch.load(_root() / final, weights_only=True)
        model, opt = _make(cls, bucket_mb=1.0)
        if how == "torch":
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(_root() / f"torch-{cls}"))
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        else:  # "cross": torch's full-state checkpoint read into the sharded layout
            src = {"sharded": "sharded", "hsdp": "hsdp"}.get(how, "torch")
            msd, osd = sdcp.get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(_root() / f"{src}-{cls}"))
            sdcp.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        assert int(opt.param_groups[0]["step"]) == 2 and opt.param_groups[0]["lr"] == 0.05
        for s in range(2, 4):
            _step(model, opt, s, rank, world)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, expected[k], **TOL, msg=f"{how} {k}")


def test_dcp_save_2_load_3(tmp_path):
    """Saved at world 2 (sharded and through torch's get_state_dict) and with HSDP at world 4,
    loaded at world 3 with another bucket size: training continues as the uninterrupted run."""
    os.environ[ROOT] = str(tmp_path)
    try:
        assert run_cases([dcp_save], 2, timeout=240)["dcp_save"] is None
        assert run_cases([dcp_save_hsdp], 4, timeout=240)["dcp_save_hsdp"] is None
        err = run_cases([dcp_load], 3, timeout=240)["dcp_load"]
    finally:
        os.environ.pop(ROOT, None)
    assert err is None, err


def async_round_trip(rank, world):
    import torch.distributed.checkpoint as dcp

    model, opt = _make("Adam")
    for s in range(2):
        _step(model, opt, s, rank, world)
    before = opt.state_dict()
    sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict(model)}
    future = dcp.async_save(sd, checkpoint_id=str(_root() / "async"))
    future.result()
    model2, opt2 = _make("Adam", bucket_mb=64 * 4 / 2**20)
    sd2 = {"model": model2.state_dict(), "optim": opt2.sharded_state_dict(model2)}
    dcp.load(sd2, checkpoint_id=str(_root() / "async"))
    model2.load_state_dict(sd2["model"])
    opt2.load_sharded_state_dict(sd2["optim"], model2)
    after = opt2.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, entry in before["state"].items():
        for name, t in entry.items():
            torch.testing.assert_close(after["state"][pid][name], t, rtol=0, atol=0)


def test_async_save_round_trip(tmp_path):
    os.environ[ROOT] = str(tmp_path)
    try:
        err = run_cases([async_round_trip], 2, timeout=240)["async_round_trip"]
    finally:
        os.environ.pop(ROOT, None)
    assert err is None, err


def save_for_torch(rank, world):
    import torch.distributed.checkpoint as dcp

    model, opt = _make("Adam")
    for s in range(2):
        _step(model, opt, s, rank, world)
    msd, osd = sdcp.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(_root() / "for-torch"))
    for s in range(2, 4):
        _step(model, opt, s, rank, world)
    if rank == 0:
        torch.save(model.state_dict(), _root() / "for-torch-final.pt")


def test_dcp_to_torch_save_loads_into_adamw(tmp_path):
    """dcp_to_torch_save of a world-2 checkpoint is a torch.optim state dict keyed by FQN:
    torch's set_optimizer_state_dict loads it into torch.optim.AdamW, which continues as
    DistributedFusedAdam did."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    os.environ[ROOT] = str(tmp_path)
    try:
        assert run_cases([save_for_torch], 2, timeout=240)["save_for_torch"] is None
    finally:
        os.environ.pop(ROOT, None)
    dcp_to_torch_save(tmp_path / "for-torch", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert full["optim"]["state"]["inp.weight"]["exp_avg"].shape == (16, 6)
    model = Net()
    model.load_state_dict(full["model"])
    adamw = torch.optim.AdamW(model.parameters(), **HP)
    set_optimizer_state_dict(model, adamw, full["optim"])
    assert adamw.state_dict()["state"][0]["step"].item() == 2
    for s in range(2, 4):
        for k in range(GLOBAL_MICRO):
            x, y = _batch(s, k)
            (nn.functional.mse_loss(model(x), y) / GLOBAL_MICRO).backward()
        adamw.step()
        adamw.zero_grad()
    expected = torch.load(tmp_path / "for-torch-final.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-5)
