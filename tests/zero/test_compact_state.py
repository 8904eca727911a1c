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
- Zero grads after small grads (unused rows, masked features): every format and master kind moves
  the params within a factor 2 of fp32-state AdamW (v is kept as its root: docs/spec.md).
- State saved in the encoding of version 1 (v itself in every format), as a state dict and as a
  sharded checkpoint, loads into every format converted: the values re-encoded, training goes on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_plan import plan_fixture, plan_params
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
#: CONFIGS and the 16-bit formats with every master kind
FORMAT_CONFIGS = dict(
    CONFIGS,
    bf16_fp32_params=(torch.float32, dict(state_format="bf16")),
    fp16_state=(torch.float32, dict(dtype=torch.float16)),
    fp16_params_fp16_state=(torch.float16, dict(dtype=torch.float16)),
    fp16_bf16_masters=(BF16, dict(state_format="fp16")),
    remainders_fp16=(BF16, dict(store_param_remainders=True, state_format="fp16")),
)


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


def _regime_opt(model, **kw):
    return shardopt.DistributedFusedAdam(
        model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        average_grad_sync=False, **kw,
    )  # fmt: skip


def _regime_run(dtype, kw, small, rank):
    """Params from 0: one step of grads ``small`` (1.0 at every 97th element), 9 of zero grads
    (rank 0's grads only, so the sums are exact); returns |params| (their movement)."""
    model = _model(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = _regime_opt(model, **kw)
    for step in range(10):
        grads = []
        for p in model.parameters():
            g = torch.full((p.numel(),), small if step == 0 else 0.0)
            if step == 0:
                g[::97] = 1.0
            grads.append(g.view(p.shape).to(dtype))
        _linear_backward(model, grads, 1.0 if rank == 0 else 0.0)
        opt.step()
        opt.zero_grad()
    return [p.detach().double().abs() for p in model.parameters()]


def zero_grads_after_small_grads(rank, world):
    """Every format and master kind moves the params within a factor 2 of fp32 state (v kept as
    v in fp16 or int8 underflowed where m did not: the params moved to 158.7 and 14.1 instead of
    0.0042)."""
    for small in (1e-3, 1e-4):
        for name, (dtype, kw) in FORMAT_CONFIGS.items():
            want = _regime_run(dtype, {}, small, rank)
            got = _regime_run(dtype, kw, small, rank)
            for i, (w, g) in enumerate(zip(want, got)):
                assert (w > 1e-3).all(), (name, small, i)
                ratio = g / w
                assert ((ratio >= 0.5) & (ratio <= 2.0)).all(), (
                    f"{name}, grads {small}, param {i}: moved {g.min().item():.3g}.."
                    f"{g.max().item():.3g}, fp32 state {w.min().item():.3g}..{w.max().item():.3g}"
                )


def _v1_round_trip(v, fmt):
    """The fp32 values a version-1 optimizer held for a flat v: v itself encoded (no root, no
    floor), as state_codec did before version 2 (blocks from element 0 of each param: params
    start on blocks)."""
    if fmt == "fp32":
        return v.clone()
    if fmt in ("bf16", "fp16", "scaled_fp16"):  # version 1 encoded v as it encodes m
        return state_codec.decode(*state_codec.encode(v, fmt, signed=True), fmt, signed=True)
    n = v.numel()  # int8: the unsigned map on v / amax
    blocks = torch.nn.functional.pad(v, (0, state_codec.num_blocks(n) * 256 - n)).view(-1, 256)
    amax = blocks.abs().amax(1)
    normal = amax >= 2.0**-126
    inv = torch.where(normal, 1.0 / torch.where(normal, amax, 1.0), 0.0)
    values = state_codec.quantization_map(False)
    mids = (values[:-1] + values[1:]) * 0.5
    codes = torch.searchsorted(mids, (blocks * inv[:, None]).contiguous())
    scale = torch.where(normal, amax, 0.0)
    return (values[codes] * scale[:, None]).view(-1)[:n]


def _v1_state_dict(dtype, kw, rank, world):
    """A state dict as a version-1 optimizer of storage ``kw`` saved it after 3 steps: m as
    today (its encoding did not change), v encoded by the version-1 rule."""
    fmt = _regime_opt(_model(dtype), **kw).storage.state_format
    model = _model(dtype)
    src = _opt(model)
    _run_for_checkpoint(model, src, range(3), rank)
    sd = src.state_dict()
    for entry in sd["state"].values():
        m, v = entry["exp_avg"], entry["exp_avg_sq"]
        entry["exp_avg"] = state_codec.decode(
            *state_codec.encode(m.reshape(-1), fmt, signed=True), fmt, signed=True
        ).view(m.shape)
        entry["exp_avg_sq"] = _v1_round_trip(v.reshape(-1), fmt).view(v.shape)
    return model, sd, fmt


def loads_version_1_state(rank, world):
    """Version-1 state (v encoded as v) as a state dict and as a sharded checkpoint loads into
    every format: the optimizer holds the values re-encoded (v as its root), both loads give the
    same state and the same training."""
    for name, (dtype, kw) in FORMAT_CONFIGS.items():
        model, sd, fmt = _v1_state_dict(dtype, kw, rank, world)
        # the checkpoint a version-1 run wrote: fp32 values (an fp32-state optimizer holds them)
        holder_model = _model(dtype)
        holder_model.load_state_dict(model.state_dict())
        holder = _opt(holder_model)
        holder.load_state_dict(sd)
        path = Path(os.environ[ROOT]) / f"v1-{name}"
        checkpoint.save(path, holder, holder_model, overwrite=True)
        loaded = {}
        for how in ("state_dict", "checkpoint"):
            m = _model(dtype)
            m.load_state_dict(model.state_dict())
            opt = _opt(m, **kw)
            if how == "state_dict":
                opt.load_state_dict(sd)
            else:
                checkpoint.load(path, opt, m)
            back = opt.state_dict()
            for i, entry in sd["state"].items():
                for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    flat = entry[k].reshape(-1)
                    want = state_codec.decode(
                        *state_codec.encode(flat, fmt, signed=signed), fmt, signed=signed
                    )
                    assert torch.equal(back["state"][i][k].reshape(-1), want), (name, how, i, k)
            _run_for_checkpoint(m, opt, range(3, 5), rank)
            loaded[how] = [p.detach().clone() for p in m.parameters()]
            for p in m.parameters():
                assert torch.isfinite(p).all() and p.abs().max() < 10, (name, how)
        for a, b in zip(loaded["state_dict"], loaded["checkpoint"]):
            assert torch.equal(_bits(a), _bits(b)), name


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
            zero_grads_after_small_grads,
            loads_version_1_state,
        ],
    ),  # fmt: skip
    (
        3,
        [
            shards_exactly,
            resume_w3,
            consolidates_to_adamw,
            memory_follows_formula,
            zero_grads_after_small_grads,
            loads_version_1_state,
        ],
    ),
]


results = plan_fixture(PLAN, ROOT, timeout=600)


@plan_params(PLAN)
def test_compact_state(results, world, case):
    results.check(world, case)
