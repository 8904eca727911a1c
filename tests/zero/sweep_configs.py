"""The seeded sweep's configurations (test_sweep.py) and what builds their optimizers.

``make_config(seed)`` draws one configuration from the seed: world size ``1 + seed % 4``, the
class, fp32 or bf16 params, the bucket size, the groups, the overlap flags and the features
(FEATURES) the run has. The builders turn a configuration into the distributed optimizer under
test and its references (torch.optim, the single-process class), its GradScaler and its injected
inf. ``run_seeds`` runs one case per seed, each at its seed's world size.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from dist_harness import run_cases

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


def features_excluded() -> frozenset:
    """The features ``SHARDOPT_SWEEP_EXCLUDE`` names (triage only); an unknown name raises."""
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


def seed_range(default: list[int]) -> list[int]:
    """The long mode's seeds: ``SHARDOPT_SWEEP_SEEDS=a-b`` (inclusive), else ``default``."""
    raw = os.environ.get("SHARDOPT_SWEEP_SEEDS")
    if not raw:
        return default
    lo, hi = (int(v) for v in raw.split("-"))
    return list(range(lo, hi + 1))


def param_groups(params, cfg: Config) -> list[dict]:
    """One group, or two (the second at half the lr) when the config has ``two_groups``."""
    params = list(params)
    if not cfg.two_groups:
        return [{"params": params}]
    cut = len(params) // 2
    return [{"params": params[:cut]}, {"params": params[cut:], "lr": HYPER[cfg.name]["lr"] / 2}]


def torch_opt_for(cfg: Config, params) -> torch.optim.Optimizer | None:
    """The torch.optim class of the same math, where there is one (none for LAMB, NovoGrad)."""
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


def single_cls(cfg: Config) -> type:
    """The single-process shardopt class of the config (FusedAdam for AdamL2)."""
    return getattr(shardopt, "FusedAdam" if cfg.name == "AdamL2" else f"Fused{cfg.name}")


def single_opt(cfg: Config, params, **extra) -> torch.optim.Optimizer:
    return single_cls(cfg)(params, **HYPER[cfg.name], **extra)


def distributed_opt(cfg: Config, params, **extra) -> torch.optim.Optimizer:
    """The DistributedFused* optimizer under test, with the config's bucket and overlap."""
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


def ddp_group() -> dist.ProcessGroup:
    """DDP's own process group (created once per rank), apart from the optimizer's."""
    if not _DDP_GROUP:
        _DDP_GROUP.append(dist.new_group(list(range(dist.get_world_size()))))
    return _DDP_GROUP[0]


def grad_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def expected_scales(cfg: Config) -> list[float]:
    """GradScaler's rule: x2 after every finite step (growth_interval=1), /2 after an inf."""
    scale, out = 2.0**8, []
    for step in range(cfg.steps):
        scale = scale / 2 if cfg.poison and cfg.poison[0] == step else scale * 2
        out.append(scale)
    return out


def poison_hook(param, cfg: Config, step: int, micro: int, rank: int):
    """An inf in ``param``'s grad at the config's poisoned (step, rank), last micro-batch."""
    if cfg.poison == (step, rank) and micro == cfg.micro - 1:
        return param.register_hook(lambda g: torch.full_like(g, float("inf")))
    return None


def run_seeds(cases: dict[int, Callable[[int, int], None]]) -> dict[int, str | None]:
    """Runs ``{seed: case}``, each case at world size ``1 + seed % 4`` (one launch per world,
    a case that hangs or breaks the process group failing alone); ``{seed: None or traceback}``."""
    out = {}
    for world in (1, 2, 3, 4):
        launch = {s: c for s, c in cases.items() if 1 + s % 4 == world}
        if not launch:
            continue
        got = run_cases(
            list(launch.values()), world, timeout=900.0, pg_timeout=15.0, report_hangs=True
        )
        for s, c in launch.items():
            out[s] = got[c.__name__]
    return out
