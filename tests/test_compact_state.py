"""Compact storage of DistributedFusedAdam (the smallest memory per param): int16 param remainders,
16-bit, scaled 16-bit and 8-bit moments (see Note: compact storage in
shardopt/zero/state_storage.py).

- Remainders are exact: the rebuilt fp32 masters and the moments are bit-identical to the fp32
  master run's on the same grads, and the params differ only at exact ties (one bf16 ulp).
- Every format shards exactly: world 2 and 3 give the same bits as one rank alone (blocks are
  param-aligned, so sharding never changes a block).
- Every format trains as Adam: against DDP + torch AdamW within the format's quantisation error.
- Checkpoints: saved at world 2 as fp32 values, resumed at world 3 bit-identical to the
  uninterrupted run; consolidated into torch AdamW and imported back from it.
- ``memory_bytes()`` follows the formula in docs/api.md for every combination.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases
from torch import nn

import shardopt
from shardopt import checkpoint, state_codec

ROOT = "SHARDOPT_TEST_COMPACT_ROOT"
BF16 = torch.bfloat16

#: name -> (param dtype, optimizer keywords)
CONFIGS = {
    "remainders": (BF16, dict(store_param_remainders=True)),
    "bf16_state": (BF16, dict(dtype=BF16)),
    "scaled_fp32_params": (torch.float32, dict(with_scaled_states=True)),
    "remainders_scaled": (BF16, dict(store_param_remainders=True, with_scaled_states=True)),
    "int8_fp32_params": (torch.float32, dict(state_format="int8")),
    "int8_bf16_masters": (BF16, dict(state_format="int8")),
    "remainders_int8": (BF16, dict(store_param_remainders=True, state_format="int8")),
}


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    # sizes off every block and alignment boundary; a param straddles buckets and chunks
    return nn.Sequential(nn.Linear(7, 300), nn.Tanh(), nn.Linear(300, 5)).to(dtype)


def _grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in model.parameters()]


def _linear_backward(model, grads, scale=1.0):
    """A backward whose grads are exactly ``grads * scale`` whatever the params' values."""
    loss = sum((p * (g * scale)).sum() for p, g in zip(model.parameters(), grads))
    loss.backward()


def _opt(model, group=None, **kw):
    return shardopt.DistributedFusedAdam(
        model.parameters(),
        lr=0.02,
        betas=(0.9, 0.99),
        weight_decay=0.05,
        bucket_cap_mb=1200 * 4 / 2**20,  # several buckets
        process_group=group,
        average_grad_sync=False,
        **kw,
    )


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_state_equal(a, b, what):
    for i, entry in a["state"].items():
        for k, v in entry.items():
            assert torch.equal(_bits(v), _bits(b["state"][i][k])), f"{what}: param {i} {k}"


# -- cases ---------------------------------------------------------------------------------------


def shards_exactly(rank, world):
    """Every format: the sharded run equals one rank alone, bit for bit (rank 0's grads only
    are nonzero, so the summed grads are exact at every world size)."""
    singles = [dist.new_group([r]) for r in range(world)]
    for name, (dtype, kw) in CONFIGS.items():
        model, alone = _model(dtype), _model(dtype)
        opt, opt1 = _opt(model, **kw), _opt(alone, group=singles[rank], **kw)
        for step in range(4):
            grads = _grads(model, step)
            _linear_backward(model, grads, 1.0 if rank == 0 else 0.0)
            _linear_backward(alone, grads)
            opt.step()
            opt1.step()
            opt.zero_grad()
            opt1.zero_grad()
        for p, q in zip(model.parameters(), alone.parameters()):
            assert torch.equal(_bits(p.detach()), _bits(q.detach())), name
        _assert_state_equal(opt.state_dict(), opt1.state_dict(), name)
        assert int(opt.param_groups[0]["step"].item()) == 4


def remainders_are_exact(rank, world):
    """store_param_remainders=True: masters and moments bit-identical to fp32 masters on the
    same grads; params equal but at exact ties, where they are one ulp apart."""
    model, other = _model(BF16), _model(BF16)
    ref, opt = _opt(model), _opt(other, store_param_remainders=True)
    ties = 0
    for step in range(6):
        grads = _grads(model, step)
        for m, o in ((model, ref), (other, opt)):
            _linear_backward(m, grads)
            o.step()
            o.zero_grad()
        a, b = ref.state_dict(), opt.state_dict()
        _assert_state_equal(a, b, f"step {step}")
        for i, p in enumerate(other.parameters()):
            master = a["state"][i]["master_param"].reshape(-1)
            rounded, remainder = state_codec.split_master(master)
            assert torch.equal(_bits(p.detach().reshape(-1)), _bits(rounded))
            q = list(model.parameters())[i].detach().reshape(-1)
            tie = remainder == -0x8000
            ties += int(tie.sum())
            assert torch.equal(_bits(q[~tie]), _bits(rounded[~tie]))
    assert opt.memory_bytes()["master"] == 0 and opt.memory_bytes()["remainder"] > 0


def trains_as_adamw(rank, world):
    """Every format follows Adam on a real loss within its quantisation error: fp32 params
    against DDP + torch AdamW, bf16 params against the fp32-master, fp32-state run (itself
    tested against DDP + AdamW in test_zero_parity.py)."""
    limits = {"fp32": 1e-2, "bf16": 3e-2, "scaled_fp16": 1e-2, "int8": 5e-2}
    for name, (dtype, kw) in CONFIGS.items():
        model, ref = _model(dtype), _model(dtype)
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, **kw)
        if dtype == torch.float32:
            ref_model = nn.parallel.DistributedDataParallel(ref)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        else:
            ref_model, ref_opt = ref, shardopt.DistributedFusedAdam(ref.parameters(), lr=1e-2)
        start = [p.detach().float().clone() for p in model.parameters()]
        for step in range(5):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)
            for m, o in ((model, opt), (ref_model, ref_opt)):
                nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
                o.step()
                o.zero_grad()
        fmt = opt.storage.state_format
        for p, q, p0 in zip(model.parameters(), ref.parameters(), start):
            moved = (q.detach().float() - p0).abs().max()
            err = (p.detach().float() - q.detach().float()).abs().max()
            ulp = p0.abs().max() * 2**-7 if dtype == BF16 else 0.0  # one bf16 rounding apart
            assert moved > 1e-3, name
            # relative to how far Adam moved the param in 5 steps of lr 1e-2
            assert err <= limits[fmt] * moved + ulp, (name, err, moved)


def _run_for_checkpoint(model, opt, steps, rank):
    for step in steps:
        _linear_backward(model, _grads(model, step), 1.0 if rank == 0 else 0.0)
        opt.step()
        opt.zero_grad()


def save_w2(rank, world):
    for name in ("remainders_int8", "remainders_scaled", "int8_fp32_params"):
        dtype, kw = CONFIGS[name]
        model = _model(dtype)
        opt = _opt(model, **kw)
        _run_for_checkpoint(model, opt, range(3), rank)
        checkpoint.save(Path(os.environ[ROOT]) / name, opt, model)
        _run_for_checkpoint(model, opt, range(3, 5), rank)
        if rank == 0:
            torch.save(model.state_dict(), Path(os.environ[ROOT]) / f"{name}-final.pt")


def resume_w3(rank, world):
    """A world-2 checkpoint resumed at world 3 (other bucket size) continues bit-identical."""
    for name in ("remainders_int8", "remainders_scaled", "int8_fp32_params"):
        dtype, kw = CONFIGS[name]
        model = _model(dtype, seed=7)
        opt = shardopt.DistributedFusedAdam(
            model.parameters(), lr=0.02, betas=(0.9, 0.99), weight_decay=0.05,
            average_grad_sync=False, **kw,
        )  # fmt: skip
        checkpoint.load(Path(os.environ[ROOT]) / name, opt, model)
        _run_for_checkpoint(model, opt, range(3, 5), rank)
        expected = torch.load(Path(os.environ[ROOT]) / f"{name}-final.pt", weights_only=True)
        for k, v in model.state_dict().items():
            assert torch.equal(_bits(v), _bits(expected[k])), (name, k)


def consolidates_to_adamw(rank, world):
    """The int8 checkpoint consolidates to a torch AdamW state (dequantised fp32); an int8
    optimizer imports that state and gives the same values back."""
    sd, model_sd = checkpoint.consolidated_state_dict(Path(os.environ[ROOT]) / "int8_fp32_params")
    model = _model()
    model.load_state_dict(model_sd)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.99), weight_decay=0.05)
    adamw.load_state_dict(sd)
    assert all(v["exp_avg"].dtype == torch.float32 for v in sd["state"].values())
    opt = _opt(model, state_format="int8")
    opt.load_state_dict(adamw.state_dict())
    back = opt.state_dict()
    for i, entry in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back["state"][i][k], entry[k]), (i, k)


def memory_follows_formula(rank, world):
    """memory_bytes() per param = P + (M + 2 x state bytes) / N, alignment padding aside."""
    for name, (dtype, kw) in CONFIGS.items():
        model = nn.Linear(1024, 512, bias=False).to(dtype)  # one big param: no padding to speak of
        opt = shardopt.DistributedFusedAdam(model.parameters(), **kw)
        n = model.weight.numel()
        total = sum(opt.memory_bytes().values())
        p_bytes = dtype.itemsize
        storage = opt.storage
        kind = {torch.float32: 0, BF16: 0 if kw.get("dtype") == BF16 else 4}[dtype]
        if storage.remainders:
            kind = 2
        state = state_codec.bytes_per_element(storage.state_format)
        formula = p_bytes + (kind + 2 * state) / world
        assert abs(total / n - formula) <= 1e-3 * formula, (name, total / n, formula)


def writes_reset_remainders(rank, world):
    """A param written after the optimizer exists becomes its master exactly (no stale
    remainder), as an fp32 master would be re-seeded."""
    model = _model(BF16)
    opt = _opt(model, store_param_remainders=True)
    _run_for_checkpoint(model, opt, range(2), rank)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    for g in opt.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    _run_for_checkpoint(model, opt, range(2, 3), rank)
    master = opt.state_dict()["state"][0]["master_param"]
    assert torch.equal(master, model[0].weight.detach().float())


def refusals(rank, world):
    model = _model()
    for kw, error, match in (
        (dict(state_format="int4"), ValueError, "state_format"),
        (dict(with_scaled_states=True, state_format="int8"), ValueError, "conflicts"),
        (dict(store_param_remainders=True, dtype=BF16), ValueError, "store_param_remainders"),
        (dict(dtype=torch.float64), TypeError, "dtype"),
    ):
        with pytest.raises(error, match=match):
            shardopt.DistributedFusedAdam(model.parameters(), **kw)
    for cls in ("LAMB", "NovoGrad", "SGD", "Adagrad"):
        kw = {"lr": 0.1} if cls == "SGD" else {}
        with pytest.raises(NotImplementedError, match="DistributedFusedAdam only"):
            getattr(shardopt, f"DistributedFused{cls}")(
                model.parameters(), state_format="int8", **kw
            )


PLAN = [
    (
        2,
        [
            shards_exactly,
            remainders_are_exact,
            trains_as_adamw,
            save_w2,
            memory_follows_formula,
            writes_reset_remainders,
            refusals,
        ],
    ),  # fmt: skip
    (3, [shards_exactly, resume_w3, consolidates_to_adamw, memory_follows_formula]),
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
            yield out
        finally:
            os.environ.pop(ROOT, None)


@pytest.mark.parametrize(
    "world,case",
    [(w, c) for w, cases in PLAN for c in cases],
    ids=lambda v: f"world{v}" if isinstance(v, int) else v.__name__,
)
def test_compact_state(results, world, case):
    err = results[(world, case.__name__)]
    assert err is None, err
