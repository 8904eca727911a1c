"""Issue 13: a seeded random sweep of the DistributedFused* optimizers against DDP + torch.optim.

Each seed draws one configuration: world size 1-4 (from the seed, so every world size, 3 included,
appears in any run of four consecutive seeds), the class, fp32 or bf16 params, the bucket size
(a few elements to 100 MB), one or two param groups, overlap flags, and which of these the run
has: frozen, unused, tied and conditional params (used on some ranks, or on no rank at some
steps), gradient accumulation with no_sync or with several synchronised backwards, clip_grad_norm
(after scaler.unscale_ under a GradScaler), a GradScaler with an inf injected on one rank.

fp32 runs train a small model; the references are DDP(find_unused_parameters=True, on a process
group of its own) with the torch.optim class where there is one (AdamW, Adam, SGD, Adagrad), and
the single-process shardopt class fed DDP's averaged grads (the same kernels), one instance per
param so that each param counts its own steps as torch.optim does (own_step_reference.py; a
grouped single-process optimizer counts per group, which differs once a param had no grad on any
rank at some step).
After every step the params are compared at the fp32 tolerance (rtol=1.3e-6, atol=1e-5) and the
references restart from the distributed params (see test_ddp_contract._anchor). clip_grad_norm's
return value is compared with clip_grad_norm_'s; a step skipped for an inf must leave every param
unchanged, and the loss scale must follow GradScaler's rule.

bf16 runs (Adam and LAMB, the classes with single-process masters) use a synthetic loss whose
grads are multiples of 1/8, summed over ranks (average_grad_sync=False) so that they are exact in
bf16, against the single-process class with master_weights=True, at the bf16 tolerance
(rtol=5e-2, atol=1e-5); the fp32 masters at the fp32 tolerance when there is no clipping.

Zero grads after small grads (``zero_grad_*`` seeds): DistributedFusedAdam in every state format
(``seed % 5``) and master kind (fp32 params, fp32 copy masters of bf16 params, bf16 params with
remainders, 16-bit params that are their own masters), world ``1 + seed % 4``, a few steps of
small grads (1e-3 to 1e-5, with some of 1.0) then 5-12 steps of zero grads (unused embedding
rows, dead units): every param within a factor 2 of the distance torch AdamW with fp32 state
moves it (compact moments that underflowed in v but not in m moved params by m / eps).

CI runs seeds 0-7 (two per world size) and zero-grad seeds 0-4 (every format, every world
size); ``pytest -m slow`` runs seeds 8-407 and zero-grad seeds 5-104.
``SHARDOPT_SWEEP_SEEDS=a-b`` runs another range in the slow test, and ``SHARDOPT_SWEEP_EXCLUDE``
(comma-separated feature names, e.g. ``synced_accumulation,global_skip``) draws configurations
without those features: for triage only, the default draws everything.
"""

from __future__ import annotations

import copy
import os
import random
from contextlib import nullcontext
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases
from own_step_reference import OwnStepReference

import shardopt

TOL = dict(rtol=1.3e-6, atol=1e-5)
BF16_TOL = dict(rtol=5e-2, atol=1e-5)
CLASSES = ("Adam", "AdamL2", "LAMB", "NovoGrad", "SGD", "Adagrad")
# eps=1e-3 for Adam and LAMB: see test_ddp_contract.HYPER
HYPER = {
    "Adam": dict(lr=0.05, weight_decay=0.1, eps=1e-3),
    "AdamL2": dict(lr=0.05, weight_decay=0.1, eps=1e-3, adam_w_mode=False),
    "LAMB": dict(lr=0.05, weight_decay=0.1, eps=1e-3, max_grad_norm=1.0),
    "NovoGrad": dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.99)),
    "SGD": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
    "Adagrad": dict(lr=0.1, weight_decay=0.1),
}
BUCKET_ELEMENTS = (5, 17, 64, 300, 5000, 25 * 2**20)  # 25M fp32 elements = 100 MB
FEATURES = (
    "frozen",
    "unused",
    "tied",
    "conditional",
    "global_skip",
    "accumulation",
    "synced_accumulation",
    "clip",
    "scaler",
    "two_groups",
    "overlap",
    "bf16",
)
FAST_SEEDS = list(range(8))
SLOW_SEEDS = list(range(8, 408))


def _exclude() -> frozenset:
    raw = os.environ.get("SHARDOPT_SWEEP_EXCLUDE", "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = names - set(FEATURES)
    if unknown:
        raise ValueError(f"SHARDOPT_SWEEP_EXCLUDE: unknown features {sorted(unknown)}")
    return names


@dataclass
class Config:
    seed: int
    world: int
    name: str
    bf16: bool
    bucket_elements: int
    two_groups: bool
    frozen: bool
    unused: bool
    tied: bool
    users: list[set[int]]  # per step: the ranks whose forward uses the conditional param
    micro: int
    synced: bool  # accumulate with several synchronised backwards (else no_sync)
    clip: float | None
    scaler: bool
    poison: tuple[int, int] | None  # (step, rank) whose grads get an inf
    overlap_grad_sync: bool
    overlap_param_sync: bool
    steps: int
    features: list[str] = field(default_factory=list)

    @property
    def global_skip(self) -> bool:
        return any(not u for u in self.users)

    def describe(self) -> str:
        return (
            f"seed {self.seed}: {self.name} {'bf16' if self.bf16 else 'fp32'} world {self.world}, "
            f"bucket {self.bucket_elements} elements, {self.steps} steps, features "
            f"[{', '.join(self.features) or 'none'}], conditional users {self.users}, micro "
            f"{self.micro} ({'synchronised' if self.synced else 'no_sync'}), clip {self.clip}, "
            f"poison {self.poison}, overlap grad/param {self.overlap_grad_sync}/"
            f"{self.overlap_param_sync}"
        )


def make_config(seed: int, exclude: frozenset = frozenset()) -> Config:
    r = random.Random(seed)
    world = 1 + seed % 4

    def coin(feature: str, p: float) -> bool:
        return feature not in exclude and r.random() < p

    name = r.choice(CLASSES)
    bf16 = name in ("Adam", "LAMB") and coin("bf16", 0.35)
    steps = r.choice((3, 4))
    conditional = coin("conditional", 0.5)
    global_skip = conditional and not bf16 and coin("global_skip", 0.5)
    users = []
    for _ in range(steps):
        if not conditional:
            users.append(set(range(world)))
        elif global_skip:
            users.append(set(range(world)) if r.random() < 0.5 else set())
        else:  # some ranks, never none
            users.append({k for k in range(world) if r.random() < 0.5} or {r.randrange(world)})
    if global_skip and all(users):
        users[r.randrange(steps)] = set()
    accumulation = coin("accumulation", 0.5)
    micro = r.choice((2, 3)) if accumulation else 1
    synced = accumulation and coin("synced_accumulation", 0.5)
    clip = r.choice((0.05, 0.5, 5.0)) if coin("clip", 0.4) else None
    scaler = coin("scaler", 0.35)
    poison = (r.randrange(steps), r.randrange(world)) if scaler and r.random() < 0.7 else None
    overlap = coin("overlap", 0.5)
    cfg = Config(
        seed=seed,
        world=world,
        name=name,
        bf16=bf16,
        bucket_elements=r.choice(BUCKET_ELEMENTS),
        two_groups=coin("two_groups", 0.5),
        frozen=coin("frozen", 0.4),
        unused=coin("unused", 0.4),
        tied=coin("tied", 0.5),
        users=users,
        micro=micro,
        synced=synced,
        clip=clip,
        scaler=scaler,
        poison=poison,
        overlap_grad_sync=not (overlap and r.random() < 0.5),
        overlap_param_sync=overlap and r.random() < 0.7,
        steps=steps,
    )
    flags = {
        "frozen": cfg.frozen,
        "unused": cfg.unused,
        "tied": cfg.tied,
        "conditional": conditional,
        "global_skip": cfg.global_skip,
        "accumulation": accumulation,
        "synced_accumulation": synced,
        "clip": clip is not None,
        "scaler": scaler,
        "two_groups": cfg.two_groups,
        "overlap": overlap,
        "bf16": bf16,
    }
    cfg.features = [f for f in FEATURES if flags[f]]
    return cfg


# -- fp32: a small model against DDP ---------------------------------------------------------


class SweepNet(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.block = nn.Linear(8, 8)  # used twice
        self.side = nn.Linear(8, 8)  # conditional
        self.out = nn.Linear(8, 11, bias=False)
        if cfg.tied:
            self.out.weight = self.emb.weight
        if cfg.unused:
            self.unused = nn.Linear(3, 3)
        if cfg.frozen:
            self.block.bias.requires_grad_(False)

    def forward(self, idx: torch.Tensor, side: bool) -> torch.Tensor:
        h = self.emb(idx)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        if side:
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def _batch(seed, step, micro, rank):
    gen = torch.Generator().manual_seed(hash((seed, step, micro, rank)) % 2**31)
    return torch.randint(0, 11, (3, 5), generator=gen), torch.randint(0, 11, (3, 5), generator=gen)


def _never(name: str, cfg: Config) -> bool:
    """Params no forward gives a grad: the unused layer, the frozen bias."""
    return name.startswith("unused.") or (cfg.frozen and name == "block.bias")


def _loss(model, cfg, step, micro, rank):
    idx, tgt = _batch(cfg.seed, step, micro, rank)
    logits = model(idx, side=rank in cfg.users[step])
    return nn.functional.cross_entropy(logits.reshape(-1, 11), tgt.reshape(-1))


def _groups(params, cfg):
    params = list(params)
    if not cfg.two_groups:
        return [{"params": params}]
    cut = len(params) // 2
    return [{"params": params[:cut]}, {"params": params[cut:], "lr": HYPER[cfg.name]["lr"] / 2}]


def _torch_opt(cfg, params):
    kw = dict(HYPER[cfg.name])
    if cfg.name == "Adam":
        return torch.optim.AdamW(params, **kw)
    if cfg.name == "AdamL2":
        kw.pop("adam_w_mode")
        return torch.optim.Adam(params, **kw)
    if cfg.name == "SGD":
        return torch.optim.SGD(params, **kw)
    if cfg.name == "Adagrad":
        return torch.optim.Adagrad(params, **kw)
    return None


def _single_cls(cfg):
    return getattr(shardopt, "FusedAdam" if cfg.name == "AdamL2" else f"Fused{cfg.name}")


def _single_opt(cfg, params, **extra):
    return _single_cls(cfg)(params, **HYPER[cfg.name], **extra)


def _distributed_opt(cfg, params, **extra):
    cls = getattr(
        shardopt, "DistributedFusedAdam" if cfg.name == "AdamL2" else f"DistributedFused{cfg.name}"
    )
    return cls(
        params,
        bucket_cap_mb=cfg.bucket_elements * 4 / 2**20,
        overlap_grad_sync=cfg.overlap_grad_sync,
        overlap_param_sync=cfg.overlap_param_sync,
        **HYPER[cfg.name],
        **extra,
    )


_DDP_GROUP: list = []


def _ddp_group():
    if not _DDP_GROUP:
        _DDP_GROUP.append(dist.new_group(list(range(dist.get_world_size()))))
    return _DDP_GROUP[0]


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def _expected_scales(cfg) -> list[float]:
    """GradScaler's rule: x2 after every finite step (growth_interval=1), /2 after an inf."""
    scale, out = 2.0**8, []
    for step in range(cfg.steps):
        scale = scale / 2 if cfg.poison and cfg.poison[0] == step else scale * 2
        out.append(scale)
    return out


def _poison_hook(param, cfg, step, micro, rank):
    if cfg.poison == (step, rank) and micro == cfg.micro - 1:
        return param.register_hook(lambda g: torch.full_like(g, float("inf")))
    return None


def _compare(model, ref, tol, what):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().float(), q.detach().float(), **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
        )


def run_fp32(cfg: Config, rank: int, world: int) -> None:
    torch.manual_seed(cfg.seed)
    model = SweepNet(cfg)
    ref = copy.deepcopy(model)
    single = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(
        ref, find_unused_parameters=True, process_group=_ddp_group()
    )
    opt = _distributed_opt(cfg, _groups(model.parameters(), cfg))
    torch_opt = _torch_opt(cfg, _groups(ref.parameters(), cfg))
    single_opt = OwnStepReference(
        _single_cls(cfg), _groups(single.parameters(), cfg), **HYPER[cfg.name]
    )
    scaler = _scaler() if cfg.scaler else None
    scales = []
    # params that never get a grad (frozen, unused) must stay exactly as they are
    untouched = [(n, p, p.detach().clone()) for n, p in model.named_parameters() if _never(n, cfg)]
    for step in range(cfg.steps):
        before = [p.detach().clone() for p in model.parameters()]
        # DDP first: its allreduces finish inside its backward on every rank
        for micro in range(cfg.micro):
            last = micro == cfg.micro - 1
            with nullcontext() if cfg.synced or last else ddp.no_sync():
                _loss(ddp, cfg, step, micro, rank).backward()
        for micro in range(cfg.micro):
            last = micro == cfg.micro - 1
            loss = _loss(model, cfg, step, micro, rank)
            if scaler is not None:
                loss = scaler.scale(loss)
            hook = _poison_hook(model.emb.weight, cfg, step, micro, rank)
            with nullcontext() if cfg.synced or last else opt.no_sync():
                loss.backward()
            if hook is not None:
                hook.remove()
        poisoned = cfg.poison is not None and cfg.poison[0] == step
        norm = None
        if cfg.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            # the scaler named: before the first step() the optimizer cannot know it otherwise
            # (GradScaler's public methods do not say whether unscale_ ran; docs/api.md)
            norm = opt.clip_grad_norm(cfg.clip, grad_scaler=scaler)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.wait_param_sync()
        if cfg.clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip)
            if not poisoned:
                torch.testing.assert_close(
                    norm.reshape(()).float(),
                    ref_norm.float(),
                    **TOL,
                    msg=lambda m, s=step: f"{cfg.describe()}: clip_grad_norm at step {s}: {m}",
                )
        for p, q in zip(single.parameters(), ref.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        if not poisoned:
            if torch_opt is not None:
                torch_opt.step()
            single_opt.step()
        ref.zero_grad(set_to_none=True)
        single.zero_grad(set_to_none=True)
        what = f"{cfg.describe()}: step {step}"
        if poisoned:
            for i, (p, b) in enumerate(zip(model.parameters(), before)):
                assert torch.equal(p.detach(), b), f"{what}: param {i} changed in a skipped step"
        for n, p, start in untouched:
            assert torch.equal(p.detach(), start), f"{what}: {n} has no grad but changed"
        if torch_opt is not None:
            _compare(model, ref, TOL, f"{what} vs DDP + {type(torch_opt).__name__}")
        _compare(model, single, TOL, f"{what} vs {_single_cls(cfg).__name__}")
        with torch.no_grad():  # every step starts from the same params (test_ddp_contract._anchor)
            for p, q, s in zip(model.parameters(), ref.parameters(), single.parameters()):
                q.copy_(p)
                s.copy_(p)
    if scaler is not None:
        assert scales == _expected_scales(cfg), f"{cfg.describe()}: loss scales {scales}"


# -- bf16: exact synthetic grads against the single-process class with masters -------------

SHAPES = [(5, 7), (13,), (3, 4, 2), (1,), (40,), (6,)]
TIED, FROZEN, COND, UNUSED, ALWAYS = 0, 1, 2, 3, 4  # roles of the params (index 5: plain)


def _start(seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in SHAPES:
        x = torch.randn(s, generator=gen)
        out.append(torch.where(x < 0, -1.0, 1.0) + x)  # |p| >= 1 (docs/spec.md)
    return out


def _exact(shape, seed, step, micro, rank, k):
    gen = torch.Generator().manual_seed(hash((seed, step, micro, rank, k)) % 2**31)
    return torch.randint(-8, 9, shape, generator=gen).float() / 8


def _terms(cfg, step, micro, rank):
    """(param index, grad) of every term of this rank's micro-batch loss sum((p * x).sum())."""
    out = []
    for i, s in enumerate(SHAPES):
        if i == UNUSED and cfg.unused:
            continue
        if i == COND and rank not in cfg.users[step]:
            continue
        out.append((i, _exact(s, cfg.seed, step, micro, rank, 0)))
        if i == TIED and cfg.tied:
            out.append((i, _exact(s, cfg.seed, step, micro, rank, 1)))  # used twice
    return out


def run_bf16(cfg: Config, rank: int, world: int) -> None:
    init = _start(cfg.seed)
    params = [nn.Parameter(t.bfloat16()) for t in init]
    refs = [nn.Parameter(t.bfloat16()) for t in init]
    if cfg.frozen:
        params[FROZEN].requires_grad_(False)
        refs[FROZEN].requires_grad_(False)
    opt = _distributed_opt(cfg, _groups(params, cfg), average_grad_sync=False)
    ref_opt = _single_opt(cfg, _groups(refs, cfg), master_weights=True)
    scaler = _scaler() if cfg.scaler else None
    scales = []
    for step in range(cfg.steps):
        before = [p.detach().clone() for p in params]
        for micro in range(cfg.micro):
            last = micro == cfg.micro - 1
            loss = sum((params[i].float() * x).sum() for i, x in _terms(cfg, step, micro, rank))
            if scaler is not None:
                loss = scaler.scale(loss)
            hook = _poison_hook(params[ALWAYS], cfg, step, micro, rank)
            with nullcontext() if cfg.synced or last else opt.no_sync():
                loss.backward()
            if hook is not None:
                hook.remove()
        poisoned = cfg.poison is not None and cfg.poison[0] == step
        norm = None
        if cfg.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            # the scaler named: before the first step() the optimizer cannot know it otherwise
            # (GradScaler's public methods do not say whether unscale_ ran; docs/api.md)
            norm = opt.clip_grad_norm(cfg.clip, grad_scaler=scaler)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.wait_param_sync()
        # the reference: grads summed over every rank's micro-batches (exact), clipped in fp32
        sums: dict[int, torch.Tensor] = {}
        for r in range(world):
            for micro in range(cfg.micro):
                for i, x in _terms(cfg, step, micro, r):
                    if refs[i].requires_grad:
                        sums[i] = sums.get(i, 0) + x
        what = f"{cfg.describe()}: step {step}"
        if cfg.clip is not None and not poisoned:
            total = torch.cat([g.double().reshape(-1) for g in sums.values()]).norm()
            torch.testing.assert_close(
                norm.reshape(()).double(), total, **TOL, msg=lambda m, w=what: f"{w}: clip norm {m}"
            )
            coef = min(1.0, cfg.clip / (float(total) + 1e-6))
            sums = {i: g * coef for i, g in sums.items()}
        for i, p in enumerate(refs):
            p.grad = sums[i].bfloat16() if i in sums else None
        if not poisoned:
            ref_opt.step()
        ref_opt.zero_grad()
        if poisoned:
            for i, (p, b) in enumerate(zip(params, before)):
                assert torch.equal(p.detach(), b), f"{what}: param {i} changed in a skipped step"
        for i in [FROZEN] * cfg.frozen + [UNUSED] * cfg.unused:
            # exact: the bf16 tolerance would hide a small wrong update (e.g. weight decay)
            assert torch.equal(params[i].detach(), init[i].bfloat16()), (
                f"{what}: param {i} ({'frozen' if i == FROZEN else 'unused'}) has no grad but "
                "changed"
            )
        for i, (p, q) in enumerate(zip(params, refs)):
            torch.testing.assert_close(
                p.float(), q.float(), **BF16_TOL, msg=lambda m, i=i, w=what: f"{w}: param {i}: {m}"
            )
    sd = opt.state_dict()
    if cfg.clip is None:
        for i, q in enumerate(refs):
            if q in ref_opt.state and "master_param" in ref_opt.state[q]:
                torch.testing.assert_close(
                    sd["state"][i]["master_param"],
                    ref_opt.state[q]["master_param"],
                    **TOL,
                    msg=lambda m, i=i: f"{cfg.describe()}: master of param {i}: {m}",
                )
    if scaler is not None:
        assert scales == _expected_scales(cfg), f"{cfg.describe()}: loss scales {scales}"


# -- zero grads after small grads: every state format ---------------------------------------------

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


def _case(seed: int):
    def case(rank, world):
        cfg = make_config(seed, _exclude())
        assert cfg.world == world
        (run_bf16 if cfg.bf16 else run_fp32)(cfg, rank, world)

    case.__name__ = case.__qualname__ = f"seed_{seed}"
    return case


def _seed_range(default: list[int]) -> list[int]:
    raw = os.environ.get("SHARDOPT_SWEEP_SEEDS")
    if not raw:
        return default
    lo, hi = (int(v) for v in raw.split("-"))
    return list(range(lo, hi + 1))


SEEDS = sorted(set(FAST_SEEDS) | set(SLOW_SEEDS) | set(_seed_range(SLOW_SEEDS)))
for _seed in SEEDS:  # module-level functions: the spawned ranks find them by name
    globals()[f"seed_{_seed}"] = _case(_seed)
for _seed in ZERO_GRAD_FAST + ZERO_GRAD_SLOW:
    globals()[f"zero_grad_{_seed}"] = _zero_grad_case(_seed)


def _run(seeds: list[int], prefix: str = "seed") -> dict[int, str | None]:
    out = {}
    for world in (1, 2, 3, 4):
        cases = [globals()[f"{prefix}_{s}"] for s in seeds if 1 + s % 4 == world]
        if not cases:
            continue
        got = run_cases(cases, world, timeout=900.0, pg_timeout=15.0, report_hangs=True)
        for s in seeds:
            if 1 + s % 4 == world:
                out[s] = got[f"{prefix}_{s}"]
    return out


@pytest.fixture(scope="module")
def fast_results():
    return _run(FAST_SEEDS)


@pytest.fixture(scope="module")
def slow_results():
    return _run(_seed_range(SLOW_SEEDS))


@pytest.fixture(scope="module")
def zero_grad_fast_results():
    return _run(ZERO_GRAD_FAST, "zero_grad")


@pytest.fixture(scope="module")
def zero_grad_slow_results():
    return _run(ZERO_GRAD_SLOW, "zero_grad")


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


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_sweep(fast_results, seed):
    err = fast_results[seed]
    assert err is None, err


@pytest.mark.slow
@pytest.mark.parametrize("seed", _seed_range(SLOW_SEEDS))
def test_sweep_long(slow_results, seed):
    err = slow_results[seed]
    assert err is None, err


def test_configs_cover_every_feature():
    """The long mode draws every feature, every class and every world size (the sweep is not
    quietly narrower than its docstring)."""
    cfgs = [make_config(s) for s in SLOW_SEEDS]
    for f in FEATURES:
        assert any(f in c.features for c in cfgs), f
    assert {c.name for c in cfgs} == set(CLASSES)
    assert {c.world for c in cfgs} == {1, 2, 3, 4}
    assert {c.bucket_elements for c in cfgs} == set(BUCKET_ELEMENTS)
    assert any(c.poison for c in cfgs) and any(c.bf16 and c.scaler for c in cfgs)
    fast = [make_config(s) for s in FAST_SEEDS]
    assert {c.world for c in fast} == {1, 2, 3, 4}
