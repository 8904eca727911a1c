"""Apex DistributedFusedAdam's surface on the distributed classes: its keyword
arguments with Apex's defaults, its methods, the groups of Apex's HSDP layout, the under-filled
bucket warning; refused options raise NotImplementedError naming the argument. Results are
compared with DDP + torch AdamW; tests/zero/apex_script.py's Apex-style cases run here on gloo."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases
from torch import nn

import shardopt

TOL = dict(rtol=1.3e-6, atol=1e-5)
APEX_DEFAULTS = dict(
    pipeline_size=2,
    contiguous_param_buffer=False,
    contiguous_grad_buffer=False,
    store_params=True,
    store_param_remainders=False,
    with_scaled_states=False,
    nccl_ub=False,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 8, generator=gen)


def apex_script_matches_ddp(rank, world):
    """An Apex-style script (every Apex keyword at its default, distributed_process_group,
    pipeline_size, init_params, parameters()) equals DDP + torch AdamW."""
    model, ref = _model(), _model()
    opt = shardopt.DistributedFusedAdam(
        model.parameters(),
        lr=1e-2,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        distributed_process_group=dist.group.WORLD,
        device="cpu",
        **dict(APEX_DEFAULTS, pipeline_size=1),
    )
    opt.init_params(reversed(list(model.parameters())))
    opt.init_params_bucket(model[0].weight)
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=dist.new_group())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(3):
        model(_batch(step, rank)).square().mean().backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        ddp(_batch(step, rank)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)


def refused_and_checked_arguments(rank, world):
    """Options whose meaning is not kept raise, naming the argument; wrong groups or devices
    are clear errors; a per-param state dtype different from the optimizer's is refused. (Apex's
    store_param_remainders, with_scaled_states and 16-bit dtype:
    tests/zero/test_compact_state.py.)"""
    for kw, error, match in (
        (dict(nccl_ub=True), ValueError, "nccl_ub=True registers CUDA buffers"),
        (dict(pipeline_size=0), ValueError, "pipeline_size"),
        (dict(device="meta"), ValueError, "device='meta'"),
        (dict(no_such_option=1), TypeError, "no_such_option"),
        (dict(dtype=torch.float64), TypeError, "dtype"),
    ):
        with pytest.raises(error, match=match):
            shardopt.DistributedFusedAdam(_model().parameters(), **kw)
    opt = shardopt.DistributedFusedAdam(_model().parameters())
    with pytest.raises(NotImplementedError, match="state dtype is set per optimizer"):
        opt.init_params(dtype=torch.float16)
    with pytest.raises(ValueError, match="not one of this optimizer's params"):
        opt.init_params([torch.zeros(3)])
    opt.init_params(dtype=torch.float32)  # the dtype in use: accepted
    if world == 2:
        # Apex's layout: process_group is shards x replicas
        with pytest.raises(ValueError, match="distributed_process_group x redundant"):
            shardopt.DistributedFusedAdam(
                _model().parameters(),
                process_group=dist.group.WORLD,
                distributed_process_group=dist.new_group([0, 1]),
                redundant_process_group=dist.new_group([0, 1]),
            )


def _fill_warning(params, **kw) -> str | None:
    """The under-filled bucket warning of a DistributedFusedAdam on ``params``, or None."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardopt.DistributedFusedAdam(params, **kw)
    found = [str(w.message) for w in caught if "bucket_cap_mb" in str(w.message)]
    assert len(found) <= 1, found
    return found[0] if found else None


def underfilled_buckets_warn(rank, world):
    """Apex's warning when the params fill less than 70% of Apex's buckets: each bucket
    ``bucket_cap_mb`` of grad-sync dtype in equal 32-element-aligned shards (rounded down), shared
    by the param groups of the same dtypes. It names the fill ratio and Apex's advice, with a cap
    that fills the buckets; that cap, taken, silences it."""
    numel = 256 * 256 + 256  # nn.Linear(256, 256), fp32 grads, starts already 32-aligned

    def cap_mb(elements):
        return elements * 4 / 2**20

    for cap in (2 * numel, numel * 3 // 2, 100 * 2**20 // 4):  # the last: 100 MB, passed
        bucket = (cap // world) // 32 * 32 * world  # one bucket holds the whole model
        ratio = numel / bucket
        message = _fill_warning(nn.Linear(256, 256).parameters(), bucket_cap_mb=cap_mb(cap))
        assert message is not None and f"fill ratio {ratio:.3f}" in message, message
        assert "Consider decreasing the bucket_cap_mb argument." in message, message
        advised = float(message.split("(bucket_cap_mb=")[1].split(" ")[0])
        assert cap_mb(numel) <= advised < cap_mb(cap), message
        assert _fill_warning(nn.Linear(256, 256).parameters(), bucket_cap_mb=advised) is None
    # the default cap is not the user's choice: no advice about it
    model = nn.Linear(256, 256)
    assert _fill_warning(model.parameters()) is None
    # Apex counts alignment gaps inside a bucket as filled: 16 params of 3 elements, 32 apart
    tiny = [nn.Parameter(torch.zeros(3)) for _ in range(16)]
    assert _fill_warning(tiny, bucket_cap_mb=cap_mb(512)) is None
    for cap in (numel, numel * 0.6, numel / 3):  # 100%, 83%, 100% (3 full buckets) at world 1
        assert _fill_warning(nn.Linear(256, 256).parameters(), bucket_cap_mb=cap_mb(cap)) is None
    # Apex's test_bucket_low_utilization_warning, scaled down: two param groups of the same
    # dtypes share Apex's buckets, so a cap of exactly the params' size fills them
    layers = [nn.Parameter(torch.ones(1, 8192 * world)) for _ in range(4)]
    groups = [{"params": layers[1::2], "lr": 0.2}, {"params": layers[0::2]}]
    exact = cap_mb(4 * 8192 * world)
    assert _fill_warning(groups, bucket_cap_mb=exact) is None
    message = _fill_warning(groups, bucket_cap_mb=2 * exact)
    assert message is not None and "fill ratio 0.500" in message, message


def fp64_params_with_fp32_state(rank, world):
    """fp64 model params with fp32 masters and state (Apex's dtype=float32): grads sync in fp32
    and the params follow DDP + AdamW on the fp32 copy of the model."""
    model, ref = _model().double(), _model()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=dist.new_group())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        model(_batch(step, rank).double()).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ddp(_batch(step, rank)).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.float(), q, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, p.float().double())  # fp32 values: the master's
    entry = opt.state_dict()["state"][0]
    assert entry["exp_avg"].dtype == torch.float32 and entry["master_param"].dtype == torch.float32


def integer_param_sync(rank, world):
    """Apex's integer param_sync_dtype of any width carries the bits of the params' values: as
    wide as the params or wider (int16, int32, int64 for bf16 params) it equals gathering in
    their dtype; narrower (int16 for fp32 params) the params are the masters rounded to nearest
    to the top bytes (torch's bf16 cast), the rest zero. (Narrower for fp16 params, uint8:
    tests/zero/test_apex_semantics.py.)"""
    models = [_model().bfloat16() for _ in range(4)]
    rounded = _model()
    sync = (None, torch.int16, torch.int32, torch.int64)
    opts = [
        shardopt.DistributedFusedAdam(m.parameters(), lr=1e-2, param_sync_dtype=d)
        for m, d in zip(models, sync)
    ]
    opts.append(
        shardopt.DistributedFusedAdam(rounded.parameters(), lr=1e-2, param_sync_dtype=torch.int16)
    )
    assert opts[2].keys[0].buffers.sync_space.dtype == torch.int32  # carried as asked
    for step in range(3):
        for m, o in zip(models + [rounded], opts):
            x = _batch(step, rank).to(next(m.parameters()).dtype)
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
    for m in models[1:]:
        for p, q in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(p, q)
    for o in opts[1:4]:  # the masters too: nothing was lost in the wider sync
        for a, b in zip(opts[0].state_dict()["state"].values(), o.state_dict()["state"].values()):
            assert torch.equal(a["master_param"], b["master_param"])
    masters = opts[4].state_dict()["state"]
    for i, p in enumerate(rounded.parameters()):
        want = masters[i]["master_param"].bfloat16().float()
        assert torch.equal(p.detach(), want)
        assert not torch.equal(want, masters[i]["master_param"])  # (the masters keep more)


def overlapped_sync_into_other_dtypes(rank, world):
    """overlap_param_sync=True with a sync dtype other than the params' (int64 bits of fp32,
    bf16 values of fp32, int32 bits of bf16: the gathered values reach the params in a copy
    after the all-gather): with one rank there is nothing to overlap, so the params hold the
    step's values when step() returns, as without overlap (Apex syncs at once on one rank; its
    test_matches_pytorch_int64_param_sync reads them there). On more ranks, they do once a
    forward of their module has run."""
    for dtype, sync in ((torch.float32, torch.int64), (torch.float32, torch.bfloat16),
                        (torch.bfloat16, torch.int32)):  # fmt: skip
        models = [_model().to(dtype) for _ in range(2)]
        opts = [
            shardopt.DistributedFusedAdam(
                m.parameters(), lr=1e-2, param_sync_dtype=sync, overlap_param_sync=overlap
            )
            for m, overlap in zip(models, (False, True))
        ]
        for step in range(3):
            for m, o in zip(models, opts):
                m(_batch(step, rank).to(dtype)).float().square().mean().backward()
                o.step()
                o.zero_grad()
            if world > 1:
                models[1](_batch(step, rank).to(dtype))  # the forward waits for the params
            for p, q in zip(*(m.parameters() for m in models)):
                assert torch.equal(p, q), (dtype, sync, step)


def nccl_ub_on_one_rank_fails_everywhere(rank, world):
    """nccl_ub=True asked on rank 0 only (gloo, CPU: refused there) raises on every rank."""
    match = "nccl_ub=True registers CUDA buffers" if rank == 0 else "rank 0 failed: .*nccl_ub"
    with pytest.raises(ValueError, match=match):
        shardopt.DistributedFusedAdam(_model().parameters(), nccl_ub=rank == 0)


class _Pool:
    """Stands in for the NCCL-registered pool (gloo has none): plain allocations."""

    def __init__(self, owner, device, groups):
        self.registered = False

    def allocating(self):
        return contextlib.nullcontext()

    def register(self, owner_object):
        self.registered = True


def persistent_grad_buffers_match_transient(rank, world):
    """nccl_ub's persistent grad buffers (here without NCCL: the pool is a stand-in) give the
    bits of the transient ones through accumulation without no_sync, no_sync, a param unused on
    every rank and clipping; memory_bytes() counts them."""
    from shardopt.zero.apex import user_buffers

    models = [_model().append(nn.Linear(4, 4)) for _ in range(2)]  # the last one never used
    saved = user_buffers.check, user_buffers.UserBuffers
    user_buffers.check, user_buffers.UserBuffers = (lambda *a: None), _Pool
    try:
        opts = [
            shardopt.DistributedFusedAdam(
                m.parameters(),
                lr=1e-2,
                weight_decay=0.1,
                bucket_cap_mb=64 * 4 / 2**20,
                nccl_ub=ub,
                overlap_param_sync=True,
            )
            for m, ub in zip(models, (True, False))
        ]
    finally:
        user_buffers.check, user_buffers.UserBuffers = saved
    assert opts[0]._user_buffers.registered
    for step in range(3):
        for m, o in zip(models, opts):
            with o.no_sync():
                m[:3](_batch(step, rank + 7)).square().mean().backward()
            m[:3](_batch(step, rank)).square().mean().backward()
            m[:3](_batch(step + 9, rank)).square().mean().backward()
            o.clip_grad_norm(0.5)
            o.step()
            o.zero_grad()
            o.wait_param_sync()
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(p, q)
    mem, plain = opts[0].memory_bytes(), opts[1].memory_bytes()
    numel = sum(b.numel for k in opts[0].keys for b in k.layout.buckets)
    assert mem.pop("grad_buckets") == 4 * numel and mem.pop("grad_shard") == 4 * numel // world
    assert mem == plain


CASES = [
    apex_script_matches_ddp,
    nccl_ub_on_one_rank_fails_everywhere,
    persistent_grad_buffers_match_transient,
    refused_and_checked_arguments,
    underfilled_buckets_warn,
    fp64_params_with_fp32_state,
    integer_param_sync,
    overlapped_sync_into_other_dtypes,
]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases(CASES, request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_apex_compat(results, case):
    world, out = results
    assert out[case.__name__] is None, out[case.__name__]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def script_results(request):
    import apex_script

    return run_cases(apex_script.CASES, request.param)


@pytest.mark.parametrize(
    "name",
    [
        "default_keywords",
        "overlapped_with_contiguous_buffers",
        "bf16_params_with_remainders",
        "grad_scaler_skips_overflow",
        "state_dict_round_trip",
        "nccl_user_buffers",
        "scaled_states_with_int32_sync",
        "uint8_sync_with_fp16_state",
        "multi_dtype_init_params",
    ],
)
def test_apex_script_unchanged_but_for_the_import(script_results, name):
    """tests/zero/apex_script.py (torchrun on GPUs) on gloo: an Apex script's uses of the optimizer
    against DDP + AdamW."""
    assert name in script_results, sorted(script_results)
    assert script_results[name] is None, script_results[name]
