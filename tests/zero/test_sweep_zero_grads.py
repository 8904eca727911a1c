"""The seeded sweep of zero grads after small grads (``zero_grad_<seed>`` cases).

DistributedFusedAdam in every state format (``seed % 5``) and master kind (fp32 params, fp32 copy
masters of bf16 params, bf16 params with remainders, 16-bit params that are their own masters),
world ``1 + seed % 4``, a few steps of small grads (1e-3 to 1e-5, with some of 1.0) then 5-12
steps of zero grads (unused embedding rows, dead units): every param within a factor 2 of the
distance torch AdamW with fp32 state moves it (compact moments that underflowed in v but not in m
moved params by m / eps).

CI runs seeds 0-4 (every format, every world size); ``pytest -m slow`` runs seeds 5-104.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from sweep_configs import BUCKET_ELEMENTS, run_seeds

import shardopt

STATE_FORMATS = ("fp32", "bf16", "fp16", "scaled_fp16", "int8")
ZERO_GRAD_FAST = list(range(5))
ZERO_GRAD_SLOW = list(range(5, 105))


@dataclass
class ZeroGradConfig:
    seed: int
    world: int
    fmt: str
    master: str  # fp32, copy, remainder or own
    small: float
    small_steps: int
    zero_steps: int
    bucket_elements: int

    def describe(self) -> str:
        return (
            f"zero-grad seed {self.seed}: {self.fmt} state, {self.master} masters, world "
            f"{self.world}, {self.small_steps} steps of grads {self.small:g} then "
            f"{self.zero_steps} of zero grads, bucket {self.bucket_elements} elements"
        )

    def params_and_kwargs(self) -> tuple[torch.dtype, dict]:
        if self.master == "own":  # Apex's dtype: 16-bit params are the masters
            dtype = torch.bfloat16 if self.fmt == "bf16" else torch.float16
            return dtype, dict(dtype=dtype)
        kw = dict(state_format=self.fmt, store_param_remainders=self.master == "remainder")
        return (torch.float32 if self.master == "fp32" else torch.bfloat16), kw


def make_zero_grad_config(seed: int) -> ZeroGradConfig:
    r = random.Random(10_000 + seed)
    fmt = STATE_FORMATS[seed % 5]
    masters = ["fp32", "copy", "remainder"] + (["own"] if fmt in ("bf16", "fp16") else [])
    return ZeroGradConfig(
        seed=seed,
        world=1 + seed % 4,
        fmt=fmt,
        master=r.choice(masters),
        small=10.0 ** -r.choice((3, 4, 5)),
        small_steps=r.choice((1, 1, 2)),
        zero_steps=r.randint(5, 12),
        bucket_elements=r.choice(BUCKET_ELEMENTS),
    )


def _zero_grad_grads(cfg: ZeroGradConfig, params, step, rank):
    """Step ``step``'s grads of this rank (the small steps' grads spread over the ranks, each
    element on one, so the sums are exact): small, of one random sign per element over the
    steps (each param moves away from 0), and some elements of 1.0."""
    fixed = torch.Generator().manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    out = []
    for p in params:
        g = torch.zeros(p.numel())
        sign = torch.randint(0, 2, (p.numel(),), generator=fixed) * 2 - 1
        ones = torch.randint(0, p.numel(), (max(1, p.numel() // 64),), generator=fixed)
        if step < cfg.small_steps:
            g = torch.empty(p.numel()).uniform_(0.5, 1.5, generator=gen) * cfg.small * sign
            g[ones] = sign[ones].float()
            owner = torch.randint(0, cfg.world, (p.numel(),), generator=gen)
            g = torch.where(owner == rank, g, 0.0)
        out.append(g.view(p.shape))
    return out


def run_zero_grads(cfg: ZeroGradConfig, rank: int, world: int) -> None:
    dtype, kw = cfg.params_and_kwargs()
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Embedding(29, 9), nn.Linear(9, 5)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ref = [torch.zeros(p.shape, requires_grad=True) for p in model.parameters()]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(), bucket_cap_mb=cfg.bucket_elements * 4 / 2**20,
        average_grad_sync=False, **hyper, **kw,
    )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref, **hyper)
    for step in range(cfg.small_steps + cfg.zero_steps):
        mine = _zero_grad_grads(cfg, ref, step, rank)
        total = [sum(_zero_grad_grads(cfg, ref, step, k)[i] for k in range(world)) for i in
                 range(len(ref))]  # fmt: skip
        sum((p * g.to(dtype)).sum() for p, g in zip(model.parameters(), mine)).backward()
        for q, g in zip(ref, total):
            q.grad = g.to(dtype).float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref):
        moved, want = p.detach().double().abs(), q.detach().double().abs()
        assert (want > 1e-4).all(), f"{cfg.describe()}: {n} did not move"
        ratio = moved / want
        assert ((ratio >= 0.5) & (ratio <= 2.0)).all(), (
            f"{cfg.describe()}: {n} moved {moved.min().item():.3g}..{moved.max().item():.3g}, "
            f"fp32-state AdamW {want.min().item():.3g}..{want.max().item():.3g}"
        )


def _zero_grad_case(seed: int):
    def case(rank, world):
        cfg = make_zero_grad_config(seed)
        assert cfg.world == world
        run_zero_grads(cfg, rank, world)

    case.__name__ = case.__qualname__ = f"zero_grad_{seed}"
    return case


for _seed in ZERO_GRAD_FAST + ZERO_GRAD_SLOW:  # module-level functions: the spawned ranks find them
    globals()[f"zero_grad_{_seed}"] = _zero_grad_case(_seed)


def _run(seeds: list[int]) -> dict[int, str | None]:
    return run_seeds({s: globals()[f"zero_grad_{s}"] for s in seeds})


@pytest.fixture(scope="module")
def zero_grad_fast_results():
    return _run(ZERO_GRAD_FAST)


@pytest.fixture(scope="module")
def zero_grad_slow_results():
    return _run(ZERO_GRAD_SLOW)


@pytest.mark.parametrize("seed", ZERO_GRAD_FAST)
def test_zero_grads_after_small_grads(zero_grad_fast_results, seed):
    err = zero_grad_fast_results[seed]
    assert err is None, err


@pytest.mark.slow
@pytest.mark.parametrize("seed", ZERO_GRAD_SLOW)
def test_zero_grads_after_small_grads_long(zero_grad_slow_results, seed):
    err = zero_grad_slow_results[seed]
    assert err is None, err


def test_zero_grad_configs_cover_every_format():
    """Every format, master kind and world size (the fast seeds: every format and world)."""
    cfgs = [make_zero_grad_config(s) for s in ZERO_GRAD_SLOW]
    assert {(c.fmt, c.world) for c in cfgs} == {(f, w) for f in STATE_FORMATS for w in (1, 2, 3, 4)}
    assert {(c.fmt, c.master) for c in cfgs} >= {
        (f, m) for f in STATE_FORMATS for m in ("fp32", "copy", "remainder")
    } | {("bf16", "own"), ("fp16", "own")}
    assert {c.small for c in cfgs} == {1e-3, 1e-4, 1e-5}
    fast = [make_zero_grad_config(s) for s in ZERO_GRAD_FAST]
    assert {c.fmt for c in fast} == set(STATE_FORMATS) and {c.world for c in fast} == {1, 2, 3, 4}
