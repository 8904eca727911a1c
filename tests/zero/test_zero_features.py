"""ZeRO features on gloo beyond plain parity: DDP equivalence, clip_grad_norm, GradScaler,
tied/unused params, HSDP-style redundant groups, state_dict round trips, memory, misuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases

import shardopt

TOL = dict(rtol=1.3e-6, atol=1e-5)


class Net(nn.Module):
    """Tied embedding/output weights, a block used twice, and an unused param."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.unused = nn.Linear(3, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))  # block used twice
        return self.out(h)


def _data(step: int, rank: int):
    gen = torch.Generator().manual_seed(7 * step + 1000 * rank)
    idx = torch.randint(0, 11, (4, 5), generator=gen)
    return idx, torch.randint(0, 11, (4, 5), generator=gen)


def _loss(model, idx, tgt, scale=1.0):
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, 11), tgt.reshape(-1)) * scale


def _avg_grads(model, step, world):
    """The rank-averaged gradient, computed locally by replaying every rank's batch; None for a
    param no rank computed a grad for (DDP(find_unused_parameters=True) leaves it None, so
    torch.optim skips it)."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    seen = [False] * len(grads)
    for r in range(world):
        model.zero_grad(set_to_none=True)
        _loss(model, *_data(step, r)).backward()
        for i, (g, p) in enumerate(zip(grads, model.parameters())):
            if p.grad is not None:
                g += p.grad / world
                seen[i] = True
    model.zero_grad(set_to_none=True)
    return [g if s else None for g, s in zip(grads, seen)]


def _assert_same(a: nn.Module, b: nn.Module, tol=TOL):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, n=n: f"{n}: {m}")


def tied_unused_reused(rank, world):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.05, weight_decay=0.1, bucket_cap_mb=64 * 4 / 2**20
    )
    ref_opt = shardopt.FusedAdam(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(3):
        _loss(model, *_data(step, rank)).backward()
        opt.step()
        for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
            p.grad = g  # None for the unused param: skipped, as torch.optim skips it
        ref_opt.step()
        _assert_same(model, ref)
    assert model.out.weight is model.emb.weight
    state = opt.state_dict()["state"]
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    for p in model.unused.parameters():
        assert float(state[ids[id(p)]]["step"]) == 0.0
        assert not state[ids[id(p)]]["exp_avg"].any()


def matches_ddp_adamw(rank, world):
    torch.manual_seed(0)
    model = Net()
    del model.unused  # DDP needs every param used
    base = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(base)
    ddp_opt = torch.optim.AdamW(base.parameters(), lr=0.05, weight_decay=0.1)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.05, weight_decay=0.1, bucket_cap_mb=100 * 4 / 2**20
    )
    for step in range(4):
        batch = _data(step, rank)
        _loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
        _loss(ddp, *batch).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    _assert_same(model, base)


def clip_grad_norm_matches_torch(rank, world):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedSGD(
        model.parameters(), lr=0.5, momentum=0.9, bucket_cap_mb=64 * 4 / 2**20
    )
    ref_opt = shardopt.FusedSGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        _loss(model, *_data(step, rank), scale=10.0).backward()
        norm = opt.clip_grad_norm(0.3)
        opt.step()
        for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
            p.grad = None if g is None else g * 10.0
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        torch.testing.assert_close(norm, ref_norm, **TOL)
        assert ref_norm > 0.3  # clipping was active
        _assert_same(model, ref)


def grad_scaler_skips_same_steps(rank, world):
    """An inf/nan on one rank skips the step on every rank, the first step included (SGD's
    momentum buffers then start at the next step, with torch's first-step rule)."""
    for make, make_ref in (
        (
            lambda ps: shardopt.DistributedFusedAdam(ps, lr=0.05, bucket_cap_mb=64 * 4 / 2**20),
            lambda ps: shardopt.FusedAdam(ps, lr=0.05),
        ),
        (
            lambda ps: shardopt.DistributedFusedSGD(
                ps, lr=0.5, momentum=0.9, dampening=0.5, bucket_cap_mb=64 * 4 / 2**20
            ),
            lambda ps: shardopt.FusedSGD(ps, lr=0.5, momentum=0.9, dampening=0.5),
        ),
    ):
        torch.manual_seed(0)
        model = Net()
        ref = copy.deepcopy(model)
        opt, ref_opt = make(model.parameters()), make_ref(ref.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        poison = {0: ("inf", world - 1), 3: ("nan", 0)}  # step -> (value, rank that injects it)
        scales = []
        for step in range(5):
            loss = _loss(model, *_data(step, rank))
            poisoned = None
            if step in poison and poison[step][1] == rank:
                # an inf/nan on ONE rank must skip the step on every rank
                bad = float(poison[step][0])
                poisoned = next(model.parameters()).register_hook(
                    lambda g, bad=bad: torch.full_like(g, bad)
                )
            scaler.scale(loss).backward()
            if poisoned is not None:
                poisoned.remove()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if step not in poison:
                for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
                    p.grad = g
                ref_opt.step()
            _assert_same(model, ref)
        assert scales == [2.0**9, 2.0**10, 2.0**11, 2.0**10, 2.0**11], scales
        assert int(opt.param_groups[0]["step"].item()) == 3


def grad_scaler_unscale_then_clip(rank, world):
    """scaler.unscale_(opt) before optimizer.clip_grad_norm (the torch AMP pattern) is harmless:
    grads never appear in .grad, so nothing is unscaled twice. SGD without active
    clipping, so a wrongly scaled grad shows in the params."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedSGD(
        model.parameters(), lr=0.5, momentum=0.9, bucket_cap_mb=64 * 4 / 2**20
    )
    ref_opt = shardopt.FusedSGD(ref.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    for step in range(3):
        scaler.scale(_loss(model, *_data(step, rank))).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm(100.0)
        scaler.step(opt)
        scaler.update()
        for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
            p.grad = g
        ref_opt.step()
        _assert_same(model, ref)
        assert all(p.grad is None for p in model.parameters())


def redundant_group_hsdp(rank, world):
    assert world == 4
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedLAMB(
        model.parameters(),
        lr=0.05,
        bucket_cap_mb=64 * 4 / 2**20,
        process_group=shard_groups[rank // 2],
        redundant_process_group=replica_groups[rank % 2],
    )
    ref_opt = shardopt.FusedLAMB(ref.parameters(), lr=0.05)
    for step in range(3):
        _loss(model, *_data(step, rank)).backward()
        opt.step()
        for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
            p.grad = g
        ref_opt.step()
        _assert_same(model, ref)


def _train(model, opt, steps, rank, start=0):
    for step in range(start, start + steps):
        _loss(model, *_data(step, rank)).backward()
        opt.step()


def state_dict_round_trip(rank, world):
    for name in ("Adam", "LAMB", "NovoGrad"):
        torch.manual_seed(0)
        model = Net()
        cls = getattr(shardopt, f"DistributedFused{name}")
        opt = cls(model.parameters(), lr=0.05, bucket_cap_mb=64 * 4 / 2**20)
        _train(model, opt, 2, rank)
        sd = opt.state_dict()
        resumed = copy.deepcopy(model)
        opt2 = cls(resumed.parameters(), lr=0.01, bucket_cap_mb=1.0)  # other buckets, other lr
        opt2.load_state_dict(sd)
        assert opt2.param_groups[0]["lr"] == 0.05
        assert int(opt2.param_groups[0]["step"].item()) == 2
        _train(model, opt, 2, rank, start=2)
        _train(resumed, opt2, 2, rank, start=2)
        _assert_same(model, resumed)
        # the full state loads into the single-process class, which continues identically
        single = copy.deepcopy(resumed)
        single_opt = getattr(shardopt, f"Fused{name}")(single.parameters(), lr=0.05)
        single_opt.load_state_dict(opt2.state_dict())
        for step in (4, 5):
            _train(resumed, opt2, 1, rank, start=step)
            for p, g in zip(single.parameters(), _avg_grads(single, step, world)):
                p.grad = g
            single_opt.step()
        _assert_same(resumed, single)


def adamw_state_dict_imports(rank, world):
    torch.manual_seed(0)
    model = Net()
    del model.unused
    ref = copy.deepcopy(model)
    adamw = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(2):
        for p, g in zip(ref.parameters(), _avg_grads(ref, step, world)):
            p.grad = g
        adamw.step()
    model.load_state_dict(ref.state_dict())
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1.0, bucket_cap_mb=64 * 4 / 2**20)
    opt.load_state_dict(adamw.state_dict())
    back = opt.state_dict()
    for pid, entry in adamw.state_dict()["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(back["state"][pid][k], entry[k], rtol=0, atol=0)
    _train(model, opt, 1, rank, start=2)
    for p, g in zip(ref.parameters(), _avg_grads(ref, 2, world)):
        p.grad = g
    adamw.step()
    _assert_same(model, ref, tol=dict(rtol=1e-5, atol=1e-6))


def memory_matches_formula(rank, world):
    # documented in the README: persistent bytes per param = P + (M + 4 * S) / N (+ padding),
    # M = 0 for fp32 params (the master is the param shard) and 4 otherwise; grads (G / N for the
    # grad shard) are transient
    for dtype, grad_dtype, states in (
        (torch.float32, torch.float32, 2),
        (torch.bfloat16, torch.float32, 2),
        (torch.bfloat16, torch.bfloat16, 2),
    ):
        params = [nn.Parameter(torch.zeros(40_000, dtype=dtype)) for _ in range(3)]
        opt = shardopt.DistributedFusedAdam(params, grad_sync_dtype=grad_dtype, bucket_cap_mb=0.05)
        n = sum(p.numel() for p in params)
        p_b, g_b = dtype.itemsize, grad_dtype.itemsize
        m_b = 0 if dtype == torch.float32 else 4
        expected = n * (p_b + (m_b + 4 * states) / world)
        total = sum(opt.memory_bytes().values())
        assert opt.keys[0].buffers._grad_shard is None
        sum(p.float().sum() for p in params).backward()
        opt.finish_grad_sync()
        shard = opt.keys[0].buffers.grad_shard
        assert shard.numel() * shard.element_size() == pytest.approx(n * g_b / world, rel=0.02)
        opt.step()
        assert opt.keys[0].buffers._grad_shard is None
        assert expected * (1 - 1e-9) <= total <= expected * 1.02, (
            dtype,
            grad_dtype,
            total,
            expected,
        )


def transient_grad_buckets_bounded(rank, world):
    """During backward at most MAX_GRAD_BUCKETS_IN_FLIGHT reduce-scatters are unwaited and at
    most two buckets are being filled; after step() no grad buffer is left."""
    from shardopt.zero.grad_sync import MAX_GRAD_BUCKETS_IN_FLIGHT

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, bucket_cap_mb=300 * 4 / 2**20)
    ref_opt = shardopt.FusedAdam(ref.parameters(), lr=0.01)
    assert len(opt.keys[0].layout.buckets) >= 8
    seen = []

    def record(_):
        live = sum(len(k.buffers.grad_buckets) for k in opt.keys)
        it = opt.grad_sync.iteration
        seen.append((live, len(it.handles) - it.next_wait))

    for p in model.parameters():  # registered after the optimizer's hooks: runs after them
        p.register_post_accumulate_grad_hook(record)
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * world + rank))
        model(x).square().mean().backward()
        opt.step()
        assert all(not k.buffers.grad_buckets and k.buffers._grad_shard is None for k in opt.keys)
        ref_grads = []
        for r in range(world):
            xr = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * world + r))
            ref.zero_grad()
            ref(xr).square().mean().backward()
            ref_grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in ref_grads) / world
        ref_opt.step()
        _assert_same(model, ref)
    assert max(live for live, _ in seen) <= 2, seen
    assert max(inflight for _, inflight in seen) <= MAX_GRAD_BUCKETS_IN_FLIGHT, seen


def misuse_params_differ(rank, world):
    params = [nn.Parameter(torch.zeros(4)) for _ in range(2 + (rank == world - 1))]
    with pytest.raises(RuntimeError, match="params differ between ranks"):
        shardopt.DistributedFusedAdam(params)


def misuse_ddp_wrapped(rank, world):
    torch.manual_seed(0)
    model = Net()
    del model.unused
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = shardopt.DistributedFusedAdam(ddp.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        _loss(ddp, *_data(0, rank)).backward()
        opt.step()


def misuse_frozen_then_unfrozen(rank, world):
    model = Net()
    model.block.bias.requires_grad_(False)
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.05)
    model.block.bias.requires_grad_(True)
    _loss(model, *_data(0, rank)).backward()
    with pytest.raises(RuntimeError, match="frozen"):
        opt.step()


DISTRIBUTED = [
    shardopt.DistributedFusedAdam,
    shardopt.DistributedFusedLAMB,
    shardopt.DistributedFusedNovoGrad,
    shardopt.DistributedFusedAdagrad,
    lambda ps, *a, **kw: shardopt.DistributedFusedSGD(ps, 0.1, *a, **kw),
]


def misuse_add_param_group_and_hyperparams(rank, world):
    """add_param_group after construction is a clear NotImplementedError; hyperparameters are
    checked as by the single-process classes (the shared check_hyperparams); torch.optim's
    foreach/fused are accepted, maximize/differentiable rejected."""
    for make in DISTRIBUTED:
        model = nn.Linear(3, 2)
        opt = make([model.weight])
        name = type(opt).__name__
        with pytest.raises(NotImplementedError, match=rf"{name}.*add_param_group.*construct"):
            opt.add_param_group({"params": [model.bias]})
        assert len(opt.param_groups) == 1
        opt.close()
        with pytest.raises(ValueError, match=r"Invalid weight_decay value: -1"):
            make(model.parameters(), weight_decay=-1.0)
        with pytest.raises(ValueError, match=r"Invalid weight_decay value: nan"):
            make(model.parameters(), weight_decay=float("nan"))
        with pytest.raises(NotImplementedError, match=rf"{name}.*differentiable"):
            make(model.parameters(), differentiable=True)
        with pytest.raises(NotImplementedError, match=rf"{name}.*maximize"):
            make(model.parameters(), maximize=True)
        make(model.parameters(), foreach=True, fused=True).close()
    for cls in (
        shardopt.DistributedFusedAdam,
        shardopt.DistributedFusedLAMB,
        shardopt.DistributedFusedNovoGrad,
    ):
        with pytest.raises(ValueError, match=r"Invalid learning rate: -1.0"):
            cls(nn.Linear(3, 2).parameters(), lr=-1.0)
        with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1.0"):
            cls(nn.Linear(3, 2).parameters(), betas=(0.9, 1.0))
        with pytest.raises(TypeError, match=r"bias_correction.*Apex's positional order"):
            cls(nn.Linear(3, 2).parameters(), 1e-3, (0.9, 0.999))


def capturable_tensor_lr(rank, world):
    """capturable=True with a device-tensor lr (what a CUDA-graph capture needs): same result as
    a float lr changed on the host; loading a state dict keeps the lr and step tensors bound."""
    for cls, kw in (
        (shardopt.DistributedFusedAdam, dict(weight_decay=0.1)),
        (shardopt.DistributedFusedLAMB, dict(weight_decay=0.1)),
        (shardopt.DistributedFusedSGD, dict(momentum=0.9)),
        (shardopt.DistributedFusedAdagrad, {}),
        (shardopt.DistributedFusedNovoGrad, dict(weight_decay=0.1)),
    ):
        torch.manual_seed(0)
        model = Net()
        del model.unused  # under capture no param is skipped (no host sync to learn which)
        ref = copy.deepcopy(model)
        lr = torch.tensor(0.05)
        opt = cls(model.parameters(), lr=lr, capturable=True, bucket_cap_mb=64 * 4 / 2**20, **kw)
        ref_opt = cls(ref.parameters(), lr=0.05, bucket_cap_mb=64 * 4 / 2**20, **kw)
        for step in range(3):
            _loss(model, *_data(step, rank)).backward()
            opt.step()
            _loss(ref, *_data(step, rank)).backward()
            ref_opt.step()
            lr.fill_(0.05 / (step + 2))  # a scheduler writing into the tensor
            ref_opt.param_groups[0]["lr"] = 0.05 / (step + 2)
        _assert_same(model, ref)
        step_t = opt.param_groups[0]["step"]
        opt.load_state_dict(ref_opt.state_dict())
        assert opt.param_groups[0]["lr"] is lr and opt.param_groups[0]["step"] is step_t
        assert float(step_t) == 3.0


def misuse_capturable(rank, world):
    model = Net()
    with pytest.raises(ValueError, match="overlap_param_sync=False"):
        shardopt.DistributedFusedAdam(model.parameters(), capturable=True, overlap_param_sync=True)
    opt = shardopt.DistributedFusedAdam(model.parameters(), capturable=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, *_data(0, rank))).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)


def overlap_param_sync_waits_in_forward(rank, world):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.05, overlap_param_sync=True, bucket_cap_mb=64 * 4 / 2**20
    )
    ref_opt = shardopt.DistributedFusedAdam(ref.parameters(), lr=0.05, bucket_cap_mb=64 * 4 / 2**20)
    for step in range(3):
        _loss(model, *_data(step, rank)).backward()  # the forward waits for the last gathers
        opt.step()
        _loss(ref, *_data(step, rank)).backward()
        ref_opt.step()
    model(torch.zeros(1, 1, dtype=torch.long))
    _assert_same(model, ref)


CASES = [
    tied_unused_reused,
    matches_ddp_adamw,
    clip_grad_norm_matches_torch,
    grad_scaler_skips_same_steps,
    grad_scaler_unscale_then_clip,
    state_dict_round_trip,
    adamw_state_dict_imports,
    memory_matches_formula,
    transient_grad_buckets_bounded,
    misuse_params_differ,
    misuse_ddp_wrapped,
    misuse_frozen_then_unfrozen,
    misuse_add_param_group_and_hyperparams,
    capturable_tensor_lr,
    misuse_capturable,
    overlap_param_sync_waits_in_forward,
]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_feature(results, case):
    err = results[case.__name__]
    assert err is None, err


def test_redundant_process_group_world4():
    err = run_cases([redundant_group_hsdp], 4)["redundant_group_hsdp"]
    assert err is None, err
