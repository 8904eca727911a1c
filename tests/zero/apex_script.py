"""Apex DistributedFusedAdam scripts, unchanged but for the import.

Each case uses the optimizer as a script written for
``apex.contrib.optimizers.distributed_fused_adam.DistributedFusedAdam`` does (Apex's keywords,
``init_params``, ``no_sync`` on every micro-batch but the last, ``clip_grad_norm``, a GradScaler
through ``scaler.step``, the DP-independent ``state_dict`` round trip at another bucket size,
``store_param_remainders``, ``nccl_ub``) with the one import line changed, and checks the model
against DDP + torch.optim.AdamW every step, as Apex's own tests do.

GPUs (NCCL): ``torchrun --nproc-per-node N tests/zero/apex_script.py`` prints PASS/FAIL per case and
exits non-zero on a failure. CPU (gloo): tests/zero/test_apex_compat.py runs the same cases at world
sizes 2 and 3.
"""

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Apex: from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
from shardopt import DistributedFusedAdam

SIZE, LAYERS, STEPS, MICRO = 48, 3, 4, 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=1.3e-6, atol=1e-5)  # fp32 (the spec's distributed tolerance)
ONE_LAYER_MB = SIZE * (SIZE + 1) * 4 / 2**20  # buckets of about one layer: several buckets


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_models(model_dtype=torch.float32, **optim_kwargs):
    """(DDP reference in fp32, its AdamW, the model in ``model_dtype``, DistributedFusedAdam)."""
    dev = _device()
    torch.manual_seed(1234)
    layers = [nn.Linear(SIZE, SIZE) for _ in range(LAYERS)]
    ref = nn.Sequential(*copy.deepcopy(layers)).to(dev)
    model = nn.Sequential(*layers).to(dev, model_dtype)
    ref_ddp = DDP(ref, device_ids=[dev.index] if dev.type == "cuda" else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = DistributedFusedAdam(model.parameters(), **HYPER, **optim_kwargs)
    return ref_ddp, ref_opt, model, opt


def micro_batches(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    dev = _device()
    return [
        (torch.randn(4, SIZE, generator=gen).to(dev), torch.randn(4, SIZE, generator=gen).to(dev))
        for _ in range(MICRO)
    ]


def backward(model, sync_context, data, dtype=torch.float32, scaler=None, poison=False):
    """Micro-batches with grad sync only on the last one (Apex's and DDP's ``no_sync``)."""
    for i, (x, y) in enumerate(data):
        last = i == len(data) - 1
        with contextlib.nullcontext() if last else sync_context():
            loss = (model(x.to(dtype)).float() - y).square().mean() / len(data)
            if poison and last:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()


def check_close(model, ref, **tol):
    """Compares through ``state_dict()`` (it waits for an overlapped param sync)."""
    ours, theirs = model.state_dict(), ref.module.state_dict()
    for name, v in theirs.items():
        torch.testing.assert_close(ours[name].float(), v, **(tol or TOL), msg=name)


def train_and_compare(ref, ref_opt, model, opt, *, clip=None, dtype=torch.float32, steps=STEPS):
    rank = dist.get_rank()
    for step in range(steps):
        data = micro_batches(step, rank)
        backward(model, opt.no_sync, data, dtype)
        if clip is not None:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        backward(ref, ref.no_sync, data)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        check_close(model, ref)


def default_keywords(rank, world):
    """Apex's defaults, params initialised in reverse order with ``init_params``."""
    ref, ref_opt, model, opt = make_models()
    opt.init_params(reversed(list(model.parameters())))
    train_and_compare(ref, ref_opt, model, opt)


def overlapped_with_contiguous_buffers(rank, world):
    """Overlapped grad and param sync, contiguous buffers, several buckets, clipping."""
    ref, ref_opt, model, opt = make_models(
        overlap_grad_sync=True,
        overlap_param_sync=True,
        contiguous_param_buffer=True,
        contiguous_grad_buffer=True,
        store_params=False,
        bucket_cap_mb=ONE_LAYER_MB,
        pipeline_size=2,
    )
    train_and_compare(ref, ref_opt, model, opt, clip=1.0)


def bf16_params_with_remainders(rank, world):
    """bf16 params with int16 remainders (no fp32 master copy): the same params as an fp32
    master (one bf16 ulp at exact ties), and close to DDP + AdamW in fp32."""
    kw = dict(dtype=torch.float32, grad_sync_dtype=torch.float32, param_sync_dtype=torch.bfloat16)
    _, _, model, opt = make_models(
        torch.bfloat16, store_params=False, store_param_remainders=True, **kw
    )
    ref, ref_opt, master_model, master_opt = make_models(torch.bfloat16, **kw)
    for step in range(STEPS):
        data = micro_batches(step, rank)
        for m, o in ((model, opt), (master_model, master_opt)):
            backward(m, o.no_sync, data, torch.bfloat16)
            o.step()
            o.zero_grad()
        for name, p in master_model.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], p, rtol=2**-7, atol=0)
    assert opt.memory_bytes()["master"] == 0 and opt.memory_bytes()["remainder"] > 0


def grad_scaler_skips_overflow(rank, world):
    """torch.amp.GradScaler through ``scaler.step(opt)``; an inf on one rank skips the step on
    every rank, as DDP + AdamW with its own scaler."""
    ref, ref_opt, model, opt = make_models()
    dev = _device().type
    scalers = [torch.amp.GradScaler(dev, init_scale=2.0**12) for _ in range(2)]
    for step in range(STEPS):
        data = micro_batches(step, rank)
        poison = step == 1 and rank == 0
        for m, o, ctx, s in (
            (model, opt, opt.no_sync, scalers[0]),
            (ref, ref_opt, ref.no_sync, scalers[1]),
        ):
            backward(m, ctx, data, scaler=s, poison=poison)
            s.step(o)
            s.update()
            o.zero_grad()
        check_close(model, ref)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() == 2.0**11  # halved once, at the skipped step


def state_dict_round_trip(rank, world):
    """The DP-independent state dict (collective, the same on every rank) loads into a new
    optimizer with another bucket size and training continues as if uninterrupted."""
    ref, ref_opt, model, opt = make_models(bucket_cap_mb=ONE_LAYER_MB)
    train_and_compare(ref, ref_opt, model, opt, steps=2)
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    del opt
    _, _, model, opt = make_models(bucket_cap_mb=3 * ONE_LAYER_MB)
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    for step in range(2, STEPS):
        data = micro_batches(step, rank)
        backward(model, opt.no_sync, data)
        opt.step()
        opt.zero_grad()
        backward(ref, ref.no_sync, data)
        ref_opt.step()
        ref_opt.zero_grad()
        check_close(model, ref)


def _train_pair(models, steps, dtype):
    """Trains (model, optimizer) pairs on the same micro-batches."""
    rank = dist.get_rank()
    for step in steps:
        data = micro_batches(step, rank)
        for m, o in models:
            backward(m, o.no_sync, data, dtype)
            o.step()
            o.zero_grad()


def scaled_states_with_int32_sync(rank, world):
    """Apex's scaled-state configuration: bf16 params, scaled 16-bit moments, params gathered as
    int32 (each carrying its bf16 bits, the rest zero), and its state dict round trip at another
    bucket size. Reference: the same bf16 model with fp32 moments gathered in bf16 (bf16 compute
    flips the sign of tiny grads against an fp32 DDP model: whole-lr differences that say
    nothing about the optimizer); the scaled moments stay within a tenth of lr of it."""
    kw = dict(with_scaled_states=True, param_sync_dtype=torch.int32)
    _, _, model, opt = make_models(torch.bfloat16, bucket_cap_mb=ONE_LAYER_MB, **kw)
    _, _, plain, plain_opt = make_models(torch.bfloat16, bucket_cap_mb=ONE_LAYER_MB)
    assert {k.buffers.sync_space.dtype for k in opt.keys} == {torch.int32}
    near = dict(rtol=0, atol=0.1 * HYPER["lr"])

    def compare():
        theirs = plain.state_dict()
        for name, v in model.state_dict().items():
            torch.testing.assert_close(v.float(), theirs[name].float(), **near, msg=name)

    _train_pair([(model, opt), (plain, plain_opt)], range(2), torch.bfloat16)
    compare()
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    assert all(t.dtype == torch.float32 for s in opt_sd["state"].values() for t in s.values())
    del opt
    _, _, model, opt = make_models(torch.bfloat16, bucket_cap_mb=3 * ONE_LAYER_MB, **kw)
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    for pid, entry in opt.state_dict()["state"].items():  # scales recomputed, values kept
        for name, value in entry.items():
            want = opt_sd["state"][pid][name]
            torch.testing.assert_close(value, want, rtol=2e-3, atol=1e-6 * want.abs().max())
    for name, v in model.state_dict().items():
        assert torch.equal(v, model_sd[name]), name  # the params are what was loaded
    _train_pair([(model, opt), (plain, plain_opt)], range(2, STEPS), torch.bfloat16)
    compare()


def uint8_sync_with_fp16_state(rank, world):
    """fp16 params gathered as uint8: each param is its master rounded to nearest to the e5m2
    top byte (torch's float8_e5m2 cast; Apex truncates and, from fp32 masters, copies fp32
    exponent bits into the fp16 layout), the rest zero. With fp32 state the params stay within
    Apex's tolerance of DDP + AdamW in fp32; with fp16 state (``dtype=torch.float16``) the
    gathered params are the same function of the masters (its second moments underflow in fp16
    for tiny grads, as Apex's do: see docs/migration.md)."""
    ref, ref_opt, model, opt = make_models(torch.float16, param_sync_dtype=torch.uint8)
    _, _, model16, opt16 = make_models(
        torch.float16, dtype=torch.float16, param_sync_dtype=torch.uint8
    )
    for step in range(STEPS):
        data = micro_batches(step, rank)
        for m, o in ((model, opt), (model16, opt16)):
            backward(m, o.no_sync, data, torch.float16)
            o.step()
            o.zero_grad()
        backward(ref, ref.no_sync, data)
        ref_opt.step()
        ref_opt.zero_grad()
        check_close(model, ref, rtol=0.5, atol=0.05)
    for m, o in ((model, opt), (model16, opt16)):
        masters = o.state_dict()["state"]
        for i, p in enumerate(m.parameters()):
            want = masters[i]["master_param"].to(torch.float8_e5m2).to(torch.float16)
            assert torch.equal(p.detach().cpu(), want), i


class TwoHeads(nn.Module):
    """Two layers whose grads do not depend on each other (the loss adds their losses)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(77)
        self.a, self.b = nn.Linear(SIZE, SIZE), nn.Linear(SIZE, SIZE)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def multi_dtype_init_params(rank, world):
    """Apex's per-param dtypes: ``init_params`` puts one layer's grads and params in bf16
    buckets while the other stays in fp32. The layers' grads are independent, so each must be
    exactly what an optimizer of its dtypes alone gives: the bf16 layer that of one built with
    bf16 sync dtypes, the fp32 one that of the default one, which equals DDP + AdamW. The state
    dict loads into an fp32-only optimizer."""
    dev = _device()
    models = [TwoHeads().to(dev) for _ in range(3)]
    ref = DDP(TwoHeads().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    bf16 = dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16)
    mixed = DistributedFusedAdam(models[0].parameters(), **HYPER, bucket_cap_mb=ONE_LAYER_MB)
    mixed.init_params(models[0].a.parameters(), **bf16)
    mixed.init_params(models[0].parameters())  # Apex's call for the rest: nothing changes
    synced = {(k.buffers.grad_dtype, k.buffers.sync_space.dtype) for k in mixed.keys}
    assert synced == {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)}, synced
    # references with the same buckets as the mixed optimizer's two keys (a 3-rank sum rounds
    # by the order of the ring, which follows the chunking): one layer each; the other layer of
    # their models only gathers grads nobody reads
    low = DistributedFusedAdam(
        models[1].a.parameters(), **HYPER, **bf16, bucket_cap_mb=ONE_LAYER_MB
    )
    high = DistributedFusedAdam(models[2].b.parameters(), **HYPER, bucket_cap_mb=ONE_LAYER_MB)
    rank = dist.get_rank()
    for step in range(STEPS):
        data = [(x, torch.cat([y, y.flip(-1)], dim=-1)) for x, y in micro_batches(step, rank)]
        for m, o, ctx in zip(models + [ref], (mixed, low, high, ref_opt), (mixed, low, high, ref)):
            backward(m, ctx.no_sync, data)
            o.step()
            o.zero_grad()
        for name, p in models[0].named_parameters():
            want = dict((models[1] if name.startswith("a.") else models[2]).named_parameters())
            assert torch.equal(p, want[name]), (step, name)
        for p, q in zip(models[2].b.parameters(), ref.module.b.parameters()):
            torch.testing.assert_close(p, q, **TOL)
    sd = mixed.state_dict()
    plain = DistributedFusedAdam(TwoHeads().to(dev).parameters(), **HYPER)
    plain.load_state_dict(sd)
    for pid, entry in plain.state_dict()["state"].items():
        for name, value in entry.items():
            if name in sd["state"][pid]:
                assert torch.equal(value, sd["state"][pid][name]), (pid, name)


def nccl_user_buffers(rank, world):
    """``nccl_ub=True`` with Apex's contiguous grad buffer (NCCL: torch's NCCL allocator or
    shardopt's own; a NotImplementedError with the reason where NCCL itself cannot), with the
    grad buckets in the registered pool; gloo refuses it clearly."""
    if _device().type != "cuda":
        try:
            make_models(nccl_ub=True)
        except ValueError as e:
            assert "nccl_ub" in str(e), e
            return
        raise AssertionError("nccl_ub=True was accepted on gloo")
    from shardopt.zero.apex import user_buffers

    reason = user_buffers.missing(_device(), [None])
    if reason is not None:  # this torch's NCCL cannot: a clear NotImplementedError
        try:
            make_models(nccl_ub=True)
        except NotImplementedError as e:
            assert "nccl_ub" in str(e) and reason in str(e), e
            if rank == 0:
                print(f"nccl_ub=True refused as this torch cannot register: {reason}")
            return
        raise AssertionError(f"nccl_ub=True was accepted although {reason}")
    ref, ref_opt, model, opt = make_models(
        nccl_ub=True, contiguous_grad_buffer=True, bucket_cap_mb=ONE_LAYER_MB
    )
    train_and_compare(ref, ref_opt, model, opt, clip=1.0)
    pool = opt._user_buffers
    assert pool.registered
    segments = pool.pool.snapshot()
    for key in opt.keys:  # the grad buckets the reduce-scatters used lie in the registered pool
        store = key.buffers._grad_store  # the persistent buckets every iteration reuses
        assert len(store) == len(key.layout.buckets) > 1
        for t in store.values():
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            assert any(
                g["address"] <= start and end <= g["address"] + g["total_size"] for g in segments
            ), "a grad bucket outside the registered pool"


CASES = [
    default_keywords,
    overlapped_with_contiguous_buffers,
    bf16_params_with_remainders,
    grad_scaler_skips_overflow,
    state_dict_round_trip,
    nccl_user_buffers,
    scaled_states_with_int32_sync,
    uint8_sync_with_fp16_state,
    multi_dtype_init_params,
]


if __name__ == "__main__":
    import torchrun_cases  # tests/zero/, beside this script

    sys.exit(torchrun_cases.run(CASES))
