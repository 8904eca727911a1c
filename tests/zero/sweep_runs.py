"""What each rank of a sweep case does (test_sweep.py): one configuration's training steps
against its references, asserting after every step.

``run_fp32``: a small model against DDP + torch.optim and the single-process class (one instance
per param: own_step_reference.py), at the fp32 tolerance. ``run_bf16``: exact synthetic grads
against the single-process class with masters, at the bf16 tolerance.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn as nn
from own_step_reference import OwnStepReference
from sweep_configs import (
    BF16_TOL,
    HYPER,
    TOL,
    Config,
    ddp_group,
    distributed_opt,
    expected_scales,
    grad_scaler,
    param_groups,
    poison_hook,
    single_cls,
    single_opt,
    torch_opt_for,
)

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


def _backward(opt, cfg: Config, loss, poisoned, at: tuple[int, int, int], scaler) -> None:
    """One micro-batch's backward at ``at = (step, micro, rank)``: scaled under a scaler, an inf
    in ``poisoned``'s grad where the config injects one, the grads synchronised on the last
    micro-batch only unless the config accumulates with synchronised backwards."""
    step, micro, rank = at
    if scaler is not None:
        loss = scaler.scale(loss)
    hook = poison_hook(poisoned, cfg, step, micro, rank)
    last = micro == cfg.micro - 1
    with nullcontext() if cfg.synced or last else opt.no_sync():
        loss.backward()
    if hook is not None:
        hook.remove()


def _clip_and_step(opt, cfg: Config, scaler, scales: list[float]) -> torch.Tensor | None:
    """The optimizer's clip_grad_norm (after unscale_ under a scaler) and step, through the
    scaler if there is one (its new scale appended to ``scales``); returns the clip norm."""
    norm = None
    if cfg.clip is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        norm = opt.clip_grad_norm(cfg.clip)  # unscaled from the first step (after unscale_)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    else:
        opt.step()
    opt.wait_param_sync()
    return norm


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
        ref, find_unused_parameters=True, process_group=ddp_group()
    )
    opt = distributed_opt(cfg, param_groups(model.parameters(), cfg))
    torch_opt = torch_opt_for(cfg, param_groups(ref.parameters(), cfg))
    single_opt = OwnStepReference(
        single_cls(cfg), param_groups(single.parameters(), cfg), **HYPER[cfg.name]
    )
    scaler = grad_scaler() if cfg.scaler else None
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
            loss = _loss(model, cfg, step, micro, rank)
            _backward(opt, cfg, loss, model.emb.weight, (step, micro, rank), scaler)
        poisoned = cfg.poison is not None and cfg.poison[0] == step
        norm = _clip_and_step(opt, cfg, scaler, scales)
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
        _compare(model, single, TOL, f"{what} vs {single_cls(cfg).__name__}")
        with torch.no_grad():  # every step starts from the same params (test_ddp_contract._anchor)
            for p, q, s in zip(model.parameters(), ref.parameters(), single.parameters()):
                q.copy_(p)
                s.copy_(p)
    if scaler is not None:
        assert scales == expected_scales(cfg), f"{cfg.describe()}: loss scales {scales}"


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
    opt = distributed_opt(cfg, param_groups(params, cfg), average_grad_sync=False)
    ref_opt = single_opt(cfg, param_groups(refs, cfg), master_weights=True)
    scaler = grad_scaler() if cfg.scaler else None
    scales = []
    for step in range(cfg.steps):
        before = [p.detach().clone() for p in params]
        for micro in range(cfg.micro):
            loss = sum((params[i].float() * x).sum() for i, x in _terms(cfg, step, micro, rank))
            _backward(opt, cfg, loss, params[ALWAYS], (step, micro, rank), scaler)
        poisoned = cfg.poison is not None and cfg.poison[0] == step
        norm = _clip_and_step(opt, cfg, scaler, scales)
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
        assert scales == expected_scales(cfg), f"{cfg.describe()}: loss scales {scales}"
