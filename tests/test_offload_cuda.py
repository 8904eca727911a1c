"""CPU offload on one GPU (NCCL, world 1): offload against no offload, memory, staging slots.

On CUDA the CPU kernels replace the CUDA ones for offloaded keys. ``test_offload_matches_gpu``
reports per class whether the results are bit-identical and checks the rest stay within one ulp
per step (fp32 masters and moments); run with ``-s`` to see which classes are exact.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from conftest import CUDA_MARKS
from torch import nn

import shardopt

pytestmark = CUDA_MARKS

CLASSES = {
    "Adam": (shardopt.DistributedFusedAdam, dict(lr=0.02, weight_decay=0.05)),
    "LAMB": (shardopt.DistributedFusedLAMB, dict(lr=0.02, max_grad_norm=1.0)),
    "NovoGrad": (shardopt.DistributedFusedNovoGrad, dict(lr=0.02, weight_decay=0.01)),
    "SGD": (shardopt.DistributedFusedSGD, dict(lr=0.05, momentum=0.9)),
    "Adagrad": (shardopt.DistributedFusedAdagrad, dict(lr=0.05)),
}
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def nccl_world1():
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 70)).cuda().to(dtype)


def _run(name, dtype, offload, clip=None):
    cls, hyper = CLASSES[name]
    model = _model(dtype)
    opt = cls(model.parameters(), **hyper, bucket_cap_mb=8000 * 4 / 2**20, offload=offload)
    gen = torch.Generator(device="cuda").manual_seed(1)
    history = []
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=gen, device="cuda").to(dtype)
        model(x).float().pow(2).mean().backward()
        if clip is not None:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        history.append([p.detach().float().cpu() for p in model.parameters()])
    return history, opt.state_dict(), opt


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in fp32 ulps of ``a``."""
    a, b = a.float(), b.float()
    spacing = torch.finfo(torch.float32).eps * a.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return float(((a - b).abs() / spacing).max()) if a.numel() else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_offload_matches_gpu(name, dtype):
    (h0, sd0, _), (h1, sd1, opt) = _run(name, dtype, None), _run(name, dtype, "cpu")
    assert all(k.buffers.offloaded for k in opt.keys)
    exact = all(torch.equal(a, b) for x, y in zip(h0, h1) for a, b in zip(x, y))
    worst = 0.0
    for pid, entry in sd0["state"].items():
        for key, t in entry.items():
            if torch.is_tensor(t) and t.dim() > 0:
                worst = max(worst, _ulps(t, sd1["state"][pid][key]))
    print(f"{name} {dtype}: bit-identical={exact} worst state difference {worst:.1f} fp32 ulps")
    if not exact:
        assert worst <= STEPS * 2, (name, dtype, worst)  # within an ulp per step (and rounding)
        for x, y in zip(h0, h1):
            for a, b in zip(x, y):
                torch.testing.assert_close(a, b, rtol=STEPS * 2 * 2**-7, atol=1e-6)


def test_offload_with_clipping_matches_gpu():
    (h0, _, _), (h1, _, _) = (
        _run("Adam", torch.bfloat16, None, 1.0),
        _run("Adam", torch.bfloat16, "cpu", 1.0),
    )
    for x, y in zip(h0, h1):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, rtol=STEPS * 2 * 2**-7, atol=1e-6)


def test_device_memory_is_freed_and_host_memory_counted():
    torch.cuda.synchronize()
    model = _model(torch.bfloat16)
    base = torch.cuda.memory_allocated()
    plain = shardopt.DistributedFusedAdam(model.parameters())
    with_state = torch.cuda.memory_allocated() - base
    plain.close()
    del plain
    model = _model(torch.bfloat16)
    base = torch.cuda.memory_allocated()
    off = shardopt.DistributedFusedAdam(model.parameters(), offload="cpu")
    offloaded = torch.cuda.memory_allocated() - base
    shard = sum(k.layout.shard_numel for k in off.keys)
    # the fp32 masters and both moments (12 B/param) left the GPU
    assert with_state - offloaded >= 12 * shard * 0.99, (with_state, offloaded, shard)
    host = off.memory_bytes("host")
    assert host["master"] == 4 * shard and host["exp_avg"] == 4 * shard
    assert off.memory_bytes()["master"] == 0 and "exp_avg" not in off.memory_bytes()


def test_staging_slots_are_pinned_and_exact_size():
    model = _model(torch.bfloat16)
    off = shardopt.DistributedFusedAdam(
        model.parameters(), bucket_cap_mb=8000 * 4 / 2**20,
        offload=shardopt.CPUOffload(staging_slots=3),
    )  # fmt: skip
    pipeline = off._offload_pipeline
    (key,) = off.keys
    chunk = max(b.chunk_numel for b in key.layout.buckets)
    expected = 3 * chunk * (4 + 2)  # fp32 grads down, bf16 params up
    assert pipeline.staging_bytes() == expected == off.memory_bytes("host")["staging"]
    assert pipeline.pinned_bytes() == expected
    for ring in list(pipeline.grad_slots.values()) + list(pipeline.out_slots.values()):
        for slot in ring.buffers:
            assert not slot.is_pinned() or slot.numel() == chunk  # registered, not cached
    x = torch.randn(16, 64, device="cuda").to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    off.step()
    torch.cuda.synchronize()
