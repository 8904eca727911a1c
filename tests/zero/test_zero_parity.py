"""ZeRO parity on gloo: every rank's params equal the single-process class fed the rank-averaged
gradient, after every step (3 steps x 3 micro-batches, no_sync on all but the last), for all five
DistributedFused classes at world sizes 1-4, with extreme hyperparameters, two param groups with
different lr, and buckets of tens of elements (params straddle buckets and shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases

import shardopt

SHAPES = [(5, 7), (13,), (3, 4, 2), (1,), (40,)]
TINY_BUCKET_MB = 48 * 4 / 2**20  # 48 fp32 elements
EXTREME = dict(lr=0.1, betas=(0.1, 0.2), eps=0.25, weight_decay=0.1)
HYPER = {
    "Adam": dict(EXTREME),
    "LAMB": dict(EXTREME, max_grad_norm=1.0),
    "NovoGrad": dict(EXTREME),
    "SGD": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
    "Adagrad": dict(lr=0.1, eps=0.25, weight_decay=0.1),
}
ENGINE_ARGS = {"grad_sync_dtype", "param_sync_dtype", "overlap_grad_sync", "overlap_param_sync"}
FP32_TOL = dict(rtol=1.3e-6, atol=1e-5)
BF16_TOL = dict(rtol=5e-2, atol=1e-5)


def _grad(shape, step, micro, rank, exact=False):
    """Per-rank micro-batch grads; ``exact`` ones are multiples of 1/8 whose sums over ranks and
    micro-batches stay exact in bf16, so a bf16 model can be compared with a bf16 reference."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if exact:
        return torch.randint(-8, 9, shape, generator=gen).float() / 8
    return torch.randn(shape, generator=gen)


def _device() -> torch.device:
    """CUDA under NCCL (torchrun on GPUs: tests/zero/nccl_parity.py), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}]


def parity(name, rank, world, *, dtype=torch.float32, steps=3, micro_batches=3, **extra):
    torch.manual_seed(0)
    device = _device()
    init = [torch.randn(s).to(device) for s in SHAPES]
    params = [torch.nn.Parameter(t.to(dtype)) for t in init]
    ref = [torch.nn.Parameter(t.to(dtype)) for t in init]
    engine_kw = {k: v for k, v in extra.items() if k in ENGINE_ARGS}
    kw = dict(HYPER[name], **{k: v for k, v in extra.items() if k not in ENGINE_ARGS})
    dist_cls = getattr(shardopt, f"DistributedFused{name}")
    if dtype != torch.float32:
        engine_kw["average_grad_sync"] = False
    opt = dist_cls(_groups(params), bucket_cap_mb=TINY_BUCKET_MB, **kw, **engine_kw)
    ref_kw = dict(kw)
    if dtype != torch.float32:
        ref_kw["master_weights"] = True
    ref_opt = getattr(shardopt, f"Fused{name}")(_groups(ref), **ref_kw)
    low_sync = extra.get("param_sync_dtype") in (torch.bfloat16, torch.float16)
    tol = FP32_TOL if dtype == torch.float32 and not low_sync else BF16_TOL
    # Low-precision models: sum instead of average, so the reference's bf16 grad is exact too.
    exact = dtype != torch.float32
    denom = 1 if exact else world
    for step in range(steps):
        avg = [torch.zeros(s, device=device) for s in SHAPES]
        for micro in range(micro_batches):
            for r in range(world):
                for a, s in zip(avg, SHAPES):
                    a += _grad(s, step, micro, r, exact).to(device) / denom
            xs = [_grad(s, step, micro, rank, exact).to(device) for s in SHAPES]
            last = micro == micro_batches - 1
            with torch.enable_grad() if last else opt.no_sync():
                sum((p.float() * x).sum() for p, x in zip(params, xs)).backward()
        opt.step()
        opt.wait_param_sync()  # params are read outside a module forward
        for p, a in zip(ref, avg):
            p.grad = a.to(dtype)
        ref_opt.step()
        for i, (p, q) in enumerate(zip(params, ref)):
            torch.testing.assert_close(
                p.float(), q.float(), **tol, msg=lambda m, i=i, s=step: f"param {i} step {s}: {m}"
            )


def parity_Adam(rank, world):
    parity("Adam", rank, world)


def parity_Adam_l2(rank, world):
    parity("Adam", rank, world, adam_w_mode=False)


def parity_LAMB(rank, world):
    parity("LAMB", rank, world)


def parity_LAMB_nvlamb(rank, world):
    parity("LAMB", rank, world, use_nvlamb=True)


def parity_LAMB_noclip(rank, world):
    # max_grad_norm=0: no clipping, so no global-norm pass or all-reduce
    parity("LAMB", rank, world, max_grad_norm=0.0)


def parity_NovoGrad(rank, world):
    parity("NovoGrad", rank, world)


def parity_NovoGrad_inf(rank, world):
    parity("NovoGrad", rank, world, norm_type=0, reg_inside_moment=True)


def parity_SGD(rank, world):
    parity("SGD", rank, world)


def parity_Adagrad(rank, world):
    parity("Adagrad", rank, world)


def parity_Adam_bf16_master(rank, world):
    parity("Adam", rank, world, dtype=torch.bfloat16)


def parity_LAMB_bf16_master(rank, world):
    parity("LAMB", rank, world, dtype=torch.bfloat16)


def parity_Adam_bf16_grad_sync(rank, world):
    parity("Adam", rank, world, dtype=torch.bfloat16, grad_sync_dtype=torch.bfloat16)


def parity_Adam_no_overlap(rank, world):
    parity("Adam", rank, world, overlap_grad_sync=False, overlap_param_sync=True)


def parity_Adam_bf16_param_sync(rank, world):
    # fp32 params gathered in bf16 (a separate all-gather buffer, copied per bucket in forward)
    parity("Adam", rank, world, param_sync_dtype=torch.bfloat16, overlap_param_sync=True)


CASES = [
    parity_Adam,
    parity_Adam_l2,
    parity_LAMB,
    parity_LAMB_nvlamb,
    parity_LAMB_noclip,
    parity_NovoGrad,
    parity_NovoGrad_inf,
    parity_SGD,
    parity_Adagrad,
    parity_Adam_bf16_master,
    parity_LAMB_bf16_master,
    parity_Adam_bf16_grad_sync,
    parity_Adam_no_overlap,
    parity_Adam_bf16_param_sync,
]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_parity(results, case):
    err = results[case.__name__]
    assert err is None, err
