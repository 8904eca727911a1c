"""DistributedFusedMuon on gloo: FusedMuon fed the rank-averaged grads, step by step.

Bit for bit at worlds 1, 2 and 4 (small-integer grads: their sums and averages are exact), within
1e-3 of the step's update norm at world 3 (and on CUDA: NCCL_CASES), at tiny (matrices larger than
a bucket), medium and huge buckets; the AdamW groups equal FusedAdam. Each peer bug of issue 46 is
a case: Newton-Schulz runs in every configuration, once per matrix and step over all ranks (on the
fully reduced grad, once under accumulation), clipping acts on the raw grads before the momentum,
bf16 params without Nesterov keep their momentum. Also: state dicts in and out of torch.optim.Muon
and FusedMuon, shardopt.checkpoint resharded 2 -> 3 -> 1, GradScaler, unused params, HSDP, the
collectives per step (DistributedFusedAdam's), misuse raising on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import pydoc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases

import shardopt
from shardopt.algorithms import muon as muon_algorithm
from shardopt.zero import comm

MUON_SHAPES = [(8, 12), (12, 8), (3, 4, 6), (16, 16), (5, 7)]  # 7 logical matrices
ADAMW_SHAPES = [(13,), (4, 6), (1,)]
SHAPES = MUON_SHAPES + ADAMW_SHAPES
MATRICES = 7
MUON = dict(lr=0.05, weight_decay=0.1, momentum=0.9)
ADAMW = dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.9))
BUCKETS = {"tiny": 48 * 4 / 2**20, "medium": 400 * 4 / 2**20, "huge": 100.0}
ROOT = "SHARDOPT_MUON_TEST_ROOT"


def _device() -> torch.device:
    """CUDA under NCCL (tests/zero/nccl_parity.py runs NCCL_CASES on GPUs), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _grad(shape, step, micro, rank):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(-4, 5, shape, generator=gen).float().to(_device())


def _params(dtype=torch.float32, shapes=SHAPES):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(_device(), dtype)) for s in shapes]


def _groups(params):
    n = len(MUON_SHAPES)
    return [{"params": params[:n]}, {"params": params[n:], "use_muon": False, **ADAMW}]


@contextlib.contextmanager
def _ns_counter():
    """Counts the matrices Newton-Schulz orthogonalizes on this rank."""
    real, seen = muon_algorithm.newton_schulz, [0]

    def counting(x, *args, **kw):
        seen[0] += x.shape[0]
        return real(x, *args, **kw)

    muon_algorithm.newton_schulz = counting
    try:
        yield seen
    finally:
        muon_algorithm.newton_schulz = real


def _total(n):
    t = torch.tensor([float(n)], device=_device())
    dist.all_reduce(t)
    return int(t.item())


def _backward(opt, params, step, rank, micro_batches, skip=()):
    for micro in range(micro_batches):
        xs = [_grad(p.shape, step, micro, rank) for p in params]
        last = micro == micro_batches - 1
        with contextlib.nullcontext() if last else opt.no_sync():
            loss = sum(
                (p.float() * x).sum() for i, (p, x) in enumerate(zip(params, xs)) if i not in skip
            )
            loss.backward()


def _avg(world, step, micro_batches, shapes=SHAPES, denom=None):
    out = []
    for s in shapes:
        total = sum(_grad(s, step, m, r) for m in range(micro_batches) for r in range(world))
        out.append(total / (denom or world))
    return out


def _close(name, got, ref, before, exact):
    """Bit for bit, or within 1e-3 of the step's update norm."""
    if exact:
        assert torch.equal(got, ref), f"{name}: max diff {(got.float() - ref.float()).abs().max()}"
        return
    norm = (ref.float() - before.float()).norm()
    assert (got.float() - ref.float()).norm() <= 1e-3 * norm + 1e-7, name


class parity_case:  # noqa: N801 (a case, named as the harness's case functions)
    """FusedMuon and FusedAdam fed the rank-averaged grads, ``steps`` x ``micro_batches``."""

    def __init__(self, bucket, *, clip=None, skip=(), hsdp=False, **engine):
        self.bucket, self.clip, self.skip, self.hsdp, self.engine = bucket, clip, skip, hsdp, engine
        options = dict(clip=clip, skip=skip, hsdp=hsdp, **engine)
        self.__name__ = "_".join(["parity", bucket] + [k for k, v in options.items() if v])

    def __call__(self, rank, world, micro_batches=2, steps=3):
        bucket, clip, skip, hsdp, engine = (
            self.bucket,
            self.clip,
            self.skip,
            self.hsdp,
            dict(self.engine),
        )
        params, ref = _params(), _params()
        adam_ref = _params(shapes=ADAMW_SHAPES)
        with torch.no_grad():
            for q, p in zip(adam_ref, ref[len(MUON_SHAPES) :]):
                q.copy_(p)
        if hsdp:
            engine.update(shardopt.zero.hsdp_groups(2)._asdict())
        opt = shardopt.DistributedFusedMuon(
            _groups(params), **MUON, bucket_cap_mb=BUCKETS[bucket], **engine
        )
        ref_opt = shardopt.FusedMuon(_groups(ref), **MUON)
        adam_opt = shardopt.FusedAdam(adam_ref, **ADAMW)
        exact = world != 3 and clip is None and _device().type == "cpu"
        for step in range(steps):
            before = [p.detach().clone() for p in ref]
            with _ns_counter() as ns:
                _backward(opt, params, step, rank, micro_batches, skip)
                if clip is not None:
                    opt.clip_grad_norm(clip)
                opt.step()
            opt.zero_grad()
            used = [i for i in range(len(MUON_SHAPES)) if i not in skip]
            want = sum(muon_algorithm.matrix_shape(SHAPES[i], False)[0] for i in used)
            want *= 2 if hsdp else 1  # (each of the 2 replicas orthogonalizes its shards)
            assert _total(ns[0]) == want, (ns[0], want)  # each matrix once, over all ranks
            for i, (q, a) in enumerate(zip(ref, _avg(world, step, micro_batches))):
                q.grad = None if i in skip else a
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([q for q in ref if q.grad is not None], clip)
            ref_opt.step()
            for q, a in zip(adam_ref, _avg(world, step, micro_batches, ADAMW_SHAPES)):
                q.grad = a
            adam_opt.step()
            for i, (p, q, b) in enumerate(zip(params, ref, before)):
                _close(f"step {step} param {i}", p.detach(), q.detach(), b, exact)
            for i, (p, q) in enumerate(zip(params[len(MUON_SHAPES) :], adam_ref)):
                if clip is not None:  # (the clip coefficient is the whole model's)
                    break
                _close(
                    f"step {step} AdamW param {i} vs FusedAdam",
                    p.detach(),
                    q.detach(),
                    q.detach(),
                    exact,
                )
        for i in skip:
            assert torch.equal(params[i].detach(), _params()[i].detach())  # never updated


def ns_is_orthogonal(rank, world):
    """The applied update is orthogonalized (singular values near 1), not the grad (SGD)."""
    params = _params()
    opt = shardopt.DistributedFusedMuon(
        _groups(params), lr=0.05, weight_decay=0.0, momentum=0.9, bucket_cap_mb=BUCKETS["tiny"]
    )
    before = [p.detach().clone() for p in params]
    _backward(opt, params, 0, rank, 1)
    opt.step()
    for p, b in zip(params[: len(MUON_SHAPES)], before):
        count, rows, cols = muon_algorithm.matrix_shape(p.shape, False)
        delta = (b - p.detach()).reshape(count, rows, cols) / (0.05 * max(1, rows / cols) ** 0.5)
        sv = torch.linalg.svdvals(delta)
        assert sv.max() < 1.3 and sv.median() > 0.6, sv  # quintic NS: about 0.7-1.2


def clip_before_momentum(rank, world):
    """A tiny max_norm scales the raw grads: the first step's orthogonalized update (momentum
    from zero) keeps its full size, as FusedMuon's after torch's clip (DeepSpeed#7713 shrank it)."""
    params, ref = _params(), _params()
    opt = shardopt.DistributedFusedMuon(_groups(params), **MUON)
    ref_opt = shardopt.FusedMuon(_groups(ref), **MUON)
    before = params[0].detach().clone()
    _backward(opt, params, 0, rank, 1)
    norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)  # torch's clip, routed to the optimizer
    opt.step()
    for q, a in zip(ref, _avg(world, 0, 1)):
        q.grad = a
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1e-3)
    ref_opt.step()
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    step = (before * (1 - 0.05 * 0.1) - params[0].detach()).norm()
    assert step > 0.05 * 0.5 * min(8, 12) ** 0.5, step  # lr x ||O|| ~ lr sqrt(rank)
    for p, q in zip(params, ref):
        _close("clipped", p.detach(), q.detach(), q.detach(), False)


def bf16_without_nesterov(rank, world):
    """bf16 params that are their own masters with bf16 momentum (torch's bf16 Muon) and
    nesterov=False: the buffer stays the EMA of the grads (torch 2.13 divides it by its norm in
    place), equal to FusedMuon's."""
    shapes = MUON_SHAPES
    params, ref = _params(torch.bfloat16, shapes), _params(torch.bfloat16, shapes)
    kw = dict(MUON, nesterov=False)
    opt = shardopt.DistributedFusedMuon(
        params, **kw, dtype=torch.bfloat16, average_grad_sync=False, bucket_cap_mb=BUCKETS["tiny"]
    )
    ref_opt = shardopt.FusedMuon(ref, **kw)
    for step in range(2):
        _backward(opt, params, step, rank, 1)
        opt.step()
        for q, a in zip(ref, _avg(world, step, 1, shapes, denom=1)):
            q.grad = a.to(torch.bfloat16)
        ref_opt.step()
        for p, q in zip(params, ref):
            assert torch.equal(p.detach(), q.detach())
    sd = opt.state_dict()
    for i, q in enumerate(ref):
        buf = sd["state"][i]["momentum_buffer"]
        # (state I/O hands out fp32 values whatever the storage: these are bf16 ones)
        assert torch.equal(buf.to(torch.bfloat16).float(), buf)
        assert torch.equal(buf.to(torch.bfloat16), ref_opt.state[q]["momentum_buffer"])
    g = _avg(world, 0, 1, shapes, denom=1)[0]
    assert sd["state"][0]["momentum_buffer"].float().norm() > 0.05 * g.norm()  # not normalised


def mixed_dtypes(rank, world):
    """One Muon group of fp32 and bf16 params, same-shape pairs among them (one Newton-Schulz
    stack of both dtypes' matrices): FusedMuon with fp32 masters, bit for bit."""
    shapes = [(8, 12), (8, 12), (16, 16), (16, 16), (13,)]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]

    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s).to(_device(), d)) for s, d in zip(shapes, dtypes)]

    def groups(ps):
        return [{"params": ps[:4]}, {"params": ps[4:], "use_muon": False, **ADAMW}]

    params, ref = make(), make()
    opt = shardopt.DistributedFusedMuon(groups(params), **MUON, bucket_cap_mb=BUCKETS["medium"])
    ref_opt = shardopt.FusedMuon(groups(ref), **MUON, master_weights=True)
    for step in range(3):
        _backward(opt, params, step, rank, 1)
        opt.step()
        opt.zero_grad()
        for q, a in zip(ref, _avg(world, step, 1, shapes)):
            q.grad = a.to(q.dtype)
        ref_opt.step()
        for i, (p, q) in enumerate(zip(params, ref)):
            assert p.dtype == q.dtype == dtypes[i]
            assert torch.equal(p.detach(), q.detach()), f"step {step} param {i} ({p.dtype})"


def remainders(rank, world):
    """store_param_remainders=True: bf16 params plus int16 remainders are the fp32 masters of
    FusedMuon(master_weights=True) (the params round half away from zero: within an ulp)."""
    shapes = MUON_SHAPES
    params, ref = _params(torch.bfloat16, shapes), _params(torch.bfloat16, shapes)
    opt = shardopt.DistributedFusedMuon(
        params, **MUON, store_param_remainders=True, bucket_cap_mb=BUCKETS["tiny"]
    )
    ref_opt = shardopt.FusedMuon(ref, **MUON, master_weights=True)
    for step in range(3):
        _backward(opt, params, step, rank, 1)
        opt.step()
        for q, a in zip(ref, _avg(world, step, 1, shapes)):
            q.grad = a.to(torch.bfloat16)
        ref_opt.step()
        for p, q in zip(params, ref):
            assert (p.float() - q.float()).abs().max() <= 2**-7 * q.float().abs().max()
    sd = opt.state_dict()
    for i, q in enumerate(ref):
        master = ref_opt.state[q]["master_param"].float()
        torch.testing.assert_close(sd["state"][i]["master_param"], master, rtol=1e-6, atol=1e-6)


def state_dicts_torch_and_fused(rank, world):
    """Ours loads into torch.optim.Muon and FusedMuon and theirs into ours; one more step of
    each agrees (2-D params: torch.optim.Muon takes no others)."""
    shapes = [(8, 12), (12, 8), (16, 16)]
    params = _params(shapes=shapes)
    opt = shardopt.DistributedFusedMuon(params, **MUON, bucket_cap_mb=BUCKETS["tiny"])
    for step in range(2):
        _backward(opt, params, step, rank, 1)
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"momentum_buffer"} and "step" not in sd["param_groups"][0]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.Muon(ref, **MUON)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    fused_opt = shardopt.FusedMuon(fused, **MUON)
    fused_opt.load_state_dict(copy.deepcopy(sd))
    _backward(opt, params, 2, rank, 1)
    opt.step()
    for qs, o in ((ref, torch_opt), (fused, fused_opt)):
        for q, a in zip(qs, _avg(world, 2, 1, shapes)):
            q.grad = a
        o.step()
    for p, q, f in zip(params, ref, fused):
        assert torch.equal(p.detach(), f.detach())
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    # torch's state dict into a new DistributedFusedMuon: the next step is torch's
    mine = [torch.nn.Parameter(q.detach().clone()) for q in ref]
    opt2 = shardopt.DistributedFusedMuon(mine, **MUON)
    opt2.load_state_dict(torch_opt.state_dict())
    _backward(opt2, mine, 3, rank, 1)
    opt2.step()
    for q, a in zip(ref, _avg(world, 3, 1, shapes)):
        q.grad = a
    torch_opt.step()
    for p, q in zip(mine, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def collectives_per_step(rank, world):
    """No collective per step beyond DistributedFusedAdam's on the same groups."""
    names = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_gather_object")

    def count(cls, **kw):
        params = _params()
        groups = _groups(params)
        if cls is shardopt.DistributedFusedAdam:
            groups = [{"params": g["params"]} for g in groups]
        opt = cls(groups, **kw)
        _backward(opt, params, 0, rank, 2)
        opt.step()
        seen = dict.fromkeys(names, 0)
        real = {n: getattr(comm, n) for n in names}
        for n in names:
            setattr(
                comm,
                n,
                lambda *a, _n=n, **k: (seen.__setitem__(_n, seen[_n] + 1), real[_n](*a, **k))[1],
            )
        try:
            _backward(opt, params, 1, rank, 2)
            opt.clip_grad_norm(10.0)
            opt.step()
        finally:
            for n in names:
                setattr(comm, n, real[n])
        return seen, sum(len(k.layout.buckets) for k in opt.keys)

    adam, adam_buckets = count(shardopt.DistributedFusedAdam, bucket_cap_mb=100.0)
    mine, my_buckets = count(shardopt.DistributedFusedMuon, bucket_cap_mb=100.0)
    assert mine == adam and adam_buckets == my_buckets, (mine, adam)
    assert mine["reduce_scatter"] == my_buckets == mine["all_gather"]
    tiny, buckets = count(shardopt.DistributedFusedMuon, bucket_cap_mb=BUCKETS["tiny"])
    assert tiny["reduce_scatter"] == buckets == tiny["all_gather"]
    assert {n: tiny[n] for n in ("all_reduce", "broadcast", "all_gather_object")} == {
        n: adam[n] for n in ("all_reduce", "broadcast", "all_gather_object")
    }


def grad_scaler(rank, world):
    """torch.amp.GradScaler: the unscaled step equals FusedMuon's; an inf on one rank skips the
    step on every rank."""
    params, ref = _params(), _params()
    opt = shardopt.DistributedFusedMuon(_groups(params), **MUON)
    ref_opt = shardopt.FusedMuon(_groups(ref), **MUON)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    xs = [_grad(p.shape, 0, 0, rank) for p in params]
    scaler.scale(sum((p * x).sum() for p, x in zip(params, xs))).backward()
    scaler.step(opt)
    scaler.update()
    for q, a in zip(ref, _avg(world, 0, 1)):
        q.grad = a
    ref_opt.step()
    for p, q in zip(params, ref):
        _close("scaled", p.detach(), q.detach(), q.detach(), world != 3)
    before = [p.detach().clone() for p in params]
    bad = float("inf") if rank == world - 1 else 1.0
    scaler.scale(sum((p * bad).sum() for p in params)).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def _root() -> Path:
    return Path(os.environ[ROOT])


def _ckpt_run(rank, world, steps, load=None, save=None):
    """``steps`` steps of grads only rank 0 has (summed: every world size sees the same)."""
    params = _params()
    opt = shardopt.DistributedFusedMuon(
        _groups(params), **MUON, average_grad_sync=False, bucket_cap_mb=BUCKETS["tiny"]
    )
    if load is not None:
        shardopt.checkpoint.load(_root() / load, opt)
    first = int(opt.param_groups[1]["step"].item())
    for step in range(first, first + steps):
        xs = [_grad(p.shape, step, 0, 0) * (rank == 0) for p in params]
        sum((p * x).sum() for p, x in zip(params, xs)).backward()
        opt.step()
    if save is not None:
        shardopt.checkpoint.save(_root() / save, opt)
    ref = _params()
    ref_opt = shardopt.FusedMuon(_groups(ref), **MUON)
    for step in range(first + steps):
        for q in ref:
            q.grad = _grad(q.shape, step, 0, 0)
        ref_opt.step()
    for i, (p, q) in enumerate(zip(params, ref)):
        assert torch.equal(p.detach(), q.detach()), f"param {i}"


def ckpt_save_2(rank, world):
    _ckpt_run(rank, world, 2, save="at2")


def ckpt_load_3(rank, world):
    _ckpt_run(rank, world, 1, load="at2", save="at3")


def dcp_save_2(rank, world):
    import torch.distributed.checkpoint as dcp

    params = _params()
    opt = shardopt.DistributedFusedMuon(_groups(params), **MUON, bucket_cap_mb=BUCKETS["tiny"])
    for step in range(2):
        _backward(opt, params, step, rank, 1)
        opt.step()
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=str(_root() / "dcp2"))
    sd = opt.state_dict()
    if rank == 0:
        torch.save(sd, _root() / "dcp2.pt")


def dcp_load_3(rank, world):
    """DCP resharded 2 -> 3: the same full state (momentum, AdamW moments, steps)."""
    import torch.distributed.checkpoint as dcp

    opt = shardopt.DistributedFusedMuon(_groups(_params()), **MUON, bucket_cap_mb=BUCKETS["medium"])
    sd = {"optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=str(_root() / "dcp2"))
    opt.load_sharded_state_dict(sd["optim"])
    got, want = opt.state_dict(), torch.load(_root() / "dcp2.pt", weights_only=False)
    assert got["state"].keys() == want["state"].keys()
    for pid, entry in want["state"].items():
        for name, value in entry.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)


def ckpt_load_1(rank, world):
    _ckpt_run(rank, world, 1, load="at3")


def _misuse_table():
    def p2():
        return torch.nn.Parameter(torch.ones(3, 4))

    def p1():
        return torch.nn.Parameter(torch.ones(3))

    return [
        (dict(lr=-1.0), ValueError, "Learning rate"),
        (dict(momentum=-0.1), ValueError, "momentum"),
        (dict(weight_decay=-0.1), ValueError, "weight decay"),
        (dict(adjust_lr_fn="spectral"), ValueError, "Adjust learning rate"),
        (dict(ns_steps=100), ValueError, "less than 100"),
        (dict(ns_coefficients=(1.0, 2.0)), ValueError, "3 values"),
        (dict(ns_dtype=torch.int32), TypeError, "ns_dtype"),
        (dict(params=[p1()]), ValueError, "only supports 2D"),
        (
            dict(params=[{"params": [p1()], "use_muon": False, "betas": (1.0, 0.9)}]),
            ValueError,
            "beta",
        ),
        (dict(offload="cpu"), NotImplementedError, "does not offload"),
        (dict(capturable=True), NotImplementedError, "capturable"),
        (dict(state_format="int8"), NotImplementedError, "state_format"),
        (dict(shard_layout=shardopt.zero.layout.ElementLayout()), ValueError, "shard_layout"),
        (dict(params=[p2()], lr_on_last_rank=-1.0), ValueError, "Learning rate"),
    ], p2


def misuse(rank, world):
    """Each misuse raises on every rank, none hangs (one rank's bad lr too)."""
    table, p2 = _misuse_table()
    for kw, exc, text in table:
        kw = dict(kw)
        params = kw.pop("params", None) or [p2()]
        if kw.pop("lr_on_last_rank", None) is not None and rank == world - 1:
            kw["lr"] = -1.0
        with pytest.raises(exc, match=text):
            shardopt.DistributedFusedMuon(params, **kw)


CASES = {
    1: [parity_case(b) for b in BUCKETS] + [ns_is_orthogonal],
    2: [parity_case(b) for b in BUCKETS]
    + [
        parity_case("tiny", skip=(1,)),
        parity_case("medium", clip=0.5),
        ns_is_orthogonal,
        clip_before_momentum,
        bf16_without_nesterov,
        remainders,
        mixed_dtypes,
        state_dicts_torch_and_fused,
        collectives_per_step,
        grad_scaler,
        misuse,
    ],
    3: [parity_case(b) for b in BUCKETS] + [ns_is_orthogonal, grad_scaler],
    4: [parity_case(b) for b in BUCKETS] + [parity_case("medium", hsdp=True), misuse],
}


#: the cases tests/zero/nccl_parity.py runs on CUDA over NCCL (within 1e-3 of the update's norm)
NCCL_CASES = [parity_case(b) for b in BUCKETS] + [
    parity_case("medium", clip=0.5),
    ns_is_orthogonal,
    clip_before_momentum,
]


@pytest.fixture(scope="module", params=sorted(CASES))
def world_results(request):
    world = request.param
    return world, run_cases(CASES[world], world, timeout=600, pg_timeout=60, report_hangs=True)


def test_distributed_muon(world_results):
    world, results = world_results
    failed = {n: e for n, e in results.items() if e is not None}
    assert not failed, f"world {world}: " + "\n".join(f"{n}: {e}" for n, e in failed.items())


def test_checkpoint_resharded_2_3_1_and_dcp_2_3(tmp_path):
    os.environ[ROOT] = str(tmp_path)
    try:
        runs = (
            (2, ckpt_save_2),
            (3, ckpt_load_3),
            (1, ckpt_load_1),
            (2, dcp_save_2),
            (3, dcp_load_3),
        )
        for world, case in runs:
            err = run_cases([case], world, timeout=300, pg_timeout=60)[case.__name__]
            assert err is None, f"world {world}: {err}"
    finally:
        os.environ.pop(ROOT, None)


def test_signature_and_help_show_every_argument():
    params = inspect.signature(shardopt.DistributedFusedMuon).parameters
    fused = inspect.signature(shardopt.FusedMuon).parameters
    for name in (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
        "ns_dtype",
        "flatten",
        "ns_algorithm",
        "ns_split",
    ):
        assert params[name].default == fused[name].default, name
    # the same positional order as FusedMuon's
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n, p in fused.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    shown = pydoc.render_doc(shardopt.DistributedFusedMuon, renderer=pydoc.plaintext)
    for name in ("bucket_cap_mb", "process_group", "state_format", "offload"):
        assert f"{name}:" in shown.split("Sharding arguments")[1], name
