"""CPU offload on one GPU (NCCL, world 1): offload against no offload, memory, staging slots.

On CUDA the CPU kernels replace the CUDA ones for offloaded keys. ``test_offload_matches_gpu``
requires the bits of the CUDA kernels from every class (LAMB's CPU sums in the CUDA kernel's order,
``lamb_stage1(cuda_order=True)``), also with tensors of many CUDA chunks
(``test_offload_lamb_matches_gpu_over_many_chunks``); ``-s`` prints each class's differences.
``test_worker_overlaps_the_next_forward`` and ``test_worker_overlaps_backward``: the offload
worker thread with overlap_param_sync, and with updates during backward. ``fraction="auto"``:
the first steps timed with CUDA events and the re-plan after them
(``test_auto_measures_the_backward_and_replans``), and the target on a model that fits without
offload, a step at most 1.1x the step without it (``test_auto_step_is_within_ten_percent_...``;
``-s`` prints the fraction, the GPU memory saved and both step times).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

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


def _model(dtype, width=64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 300), nn.Tanh(), nn.Linear(300, 70)).cuda().to(dtype)


def _run(name, dtype, offload, clip=None, width=64, bucket_cap_mb=8000 * 4 / 2**20):
    cls, hyper = CLASSES[name]
    model = _model(dtype, width)
    opt = cls(model.parameters(), **hyper, bucket_cap_mb=bucket_cap_mb, offload=offload)
    gen = torch.Generator(device="cuda").manual_seed(1)
    history = []
    for _ in range(STEPS):
        x = torch.randn(16, width, generator=gen, device="cuda").to(dtype)
        model(x).float().pow(2).mean().backward()
        if clip is not None:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        history.append([p.detach().float().cpu() for p in model.parameters()])
    return history, opt.state_dict(), opt


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between ``a`` and ``b`` in fp32 ulps of ``a``'s largest magnitude
    (a moment that crosses zero differs by ulps of its terms, not of its tiny value)."""
    a, b = a.float(), b.float()
    if not a.numel():
        return 0.0
    scale = a.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((a - b).abs().max() / (scale * torch.finfo(torch.float32).eps))


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
    assert exact and worst == 0.0, (name, dtype, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_lamb_matches_gpu_over_many_chunks(dtype):
    """LAMB's per-tensor sums over tensors of several CUDA chunks (65,536 elements each: the
    first layer's 1,500 x 300 weight, in one bucket), with its built-in clipping: the CPU sums
    take the CUDA kernel's order. (test_offload_matches_gpu's small buckets split params over
    several buckets: their pieces' sums are added in a fixed order, ``sum_by_param``.)"""
    (h0, sd0, _), (h1, sd1, _) = (
        _run("LAMB", dtype, None, width=1500, bucket_cap_mb=8.0),
        _run("LAMB", dtype, "cpu", width=1500, bucket_cap_mb=8.0),
    )
    for x, y in zip(h0, h1):
        for a, b in zip(x, y):
            assert torch.equal(a, b)
    for pid, entry in sd0["state"].items():
        for key, t in entry.items():
            if torch.is_tensor(t):
                assert torch.equal(t, sd1["state"][pid][key]), (pid, key)


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


class _SlowAdam(shardopt.DistributedFusedAdam):
    """Adam whose offloaded bucket updates (on the offload worker thread) take ``delay`` s."""

    delay = 0.0

    def _update(self, scalars):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(self.delay)
        super()._update(scalars)


def _overlap_run(overlap: bool, offload):
    model = _model(torch.bfloat16)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.02, bucket_cap_mb=8000 * 4 / 2**20, offload=offload,
        overlap_param_sync=overlap,
    )  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(1)
    history = []
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=gen, device="cuda").to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()  # waits bucket by bucket with overlap
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.5  # a scheduler while the worker may still run the step
        opt.zero_grad()
    opt.wait_param_sync()
    history.append([p.detach().float().cpu() for p in model.parameters()])
    return history, opt.state_dict()


def test_worker_overlaps_the_next_forward():
    """The offload worker: with overlap_param_sync the same bits as without it (the per-bucket
    events order the all-gathers after their copies), close to no offload; step() returns
    before the worker is done and the first layer's forward waits only for its buckets."""
    h_sync, sd_sync = _overlap_run(False, "cpu")
    h_over, sd_over = _overlap_run(True, "cpu")
    h_gpu, _ = _overlap_run(True, None)
    for x, y, z in zip(h_sync[0], h_over[0], h_gpu[0]):
        assert torch.equal(x, y)
        torch.testing.assert_close(y, z, rtol=STEPS * 2 * 2**-7, atol=1e-6)
    for pid, entry in sd_sync["state"].items():
        for key, t in entry.items():
            if torch.is_tensor(t):
                assert torch.equal(t, sd_over["state"][pid][key]), (pid, key)
    model = _model(torch.bfloat16)
    opt = _SlowAdam(model.parameters(), lr=0.02, bucket_cap_mb=8000 * 4 / 2**20, offload="cpu",
                    overlap_param_sync=True)  # fmt: skip
    x = torch.randn(16, 64, device="cuda").to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.delay = 0.2
    start = time.perf_counter()
    opt.step()
    returned = time.perf_counter() - start
    progress = opt.param_sync.progress
    buckets = len(progress.order)
    assert buckets > 2 and returned < 0.2 * buckets / 2, (returned, buckets)
    assert not progress.finished
    model[0](x)  # the first layer
    assert 0 < opt.param_sync._issued < buckets
    opt.wait_param_sync()
    torch.cuda.synchronize()
    assert opt.param_sync.progress is None
    opt.close()
    assert not opt._offload_pipeline.worker.alive


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda.synchronize()
        time.sleep(0.3)
        return g


def test_worker_overlaps_backward():
    """CPUOffload(overlap_backward=True): the same bits as overlap_backward=False (both run the
    CPU kernels), and the last layer's bucket is updated before backward ends."""
    from shardopt.zero.offload.worker import Progress

    runs = []
    for mode in (False, True):
        model = _model(torch.bfloat16)
        opt = shardopt.DistributedFusedAdam(
            model.parameters(), lr=0.02, bucket_cap_mb=8000 * 4 / 2**20,
            offload=shardopt.CPUOffload(overlap_backward=mode),
        )  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(1)
        stamps, ends = [], []

        def last_grad(p, ends=ends) -> None:  # a hook must return None
            torch.cuda.synchronize()
            ends.append(time.perf_counter())

        model[0].weight.register_post_accumulate_grad_hook(last_grad)
        publish = Progress.publish

        def stamped(self, bucket_id, event, stamps=stamps, publish=publish):
            stamps.append(time.perf_counter())
            publish(self, bucket_id, event)

        Progress.publish = stamped
        try:
            for _ in range(STEPS):
                x = torch.randn(16, 64, generator=gen, device="cuda").to(torch.bfloat16)
                h = _SlowBackward.apply(model[0](x))
                model[2](model[1](h)).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            Progress.publish = publish
        if mode:  # the first bucket update of the first step ended before its backward did
            assert min(stamps) < ends[0], (stamps[:3], ends[:1])
        runs.append(([p.detach().float().cpu() for p in model.parameters()], opt.state_dict()))
    (p0, sd0), (p1, sd1) = runs
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for pid, entry in sd0["state"].items():
        for key, t in entry.items():
            if torch.is_tensor(t):
                assert torch.equal(t, sd1["state"][pid][key]), (pid, key)


# -- fraction="auto": the measured backward and the re-plan ---------------------------------------


def _gpt_like(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks).cuda().to(torch.bfloat16)


def _train_ms(model, opt, steps: int, rows: int, width: int) -> float:
    """The mean time (ms) of ``steps`` iterations (forward + backward + step; the last step's
    worker and all-gathers waited for at the end only, so they overlap the next forward)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, width, generator=gen, device="cuda", dtype=torch.bfloat16)
    opt.wait_param_sync()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_param_sync()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def test_auto_measures_the_backward_and_replans():
    """fraction="auto" on a model that fits: the first steps are timed with CUDA events, the
    decision after step 3 names what it measured, is logged once, and memory_bytes() and
    ``device_bytes_saved`` agree with the state that left the GPU; the run stays close to the
    run without offload (the CPU kernels replace the CUDA ones for the offloaded part)."""
    import logging

    class _Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record) -> None:
            self.lines.append(record.getMessage())

    records = _Records()
    logger = logging.getLogger("shardopt")
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        runs = []
        for offload in (None, shardopt.CPUOffload(fraction="auto", overlap_backward="auto")):
            model = _gpt_like(1024, 4)
            opt = shardopt.DistributedFusedAdam(
                model.parameters(), lr=1e-3, bucket_cap_mb=16, offload=offload,
                overlap_param_sync=True,
            )  # fmt: skip
            _train_ms(model, opt, 6, 2048, 1024)
            runs.append((model, opt))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    (plain_model, plain), (model, opt) = runs
    plan = opt.offload_plan
    print(f"auto: fraction {plan.fraction:.3f}; {plan.reason}")
    assert plan.replanned_at_step == 3 and 0.0 <= plan.fraction <= 1.0, plan
    m = plan.measurements
    assert m["backward_ms"] > 0 and m["forward_ms"] > 0, m
    assert m["cpu_ms"] > 0 and m["copy_ms"] > 0 and m["gpu_ms"] > 0 and m["free_bytes"] > 0, m
    lines = [line for line in records.lines if "CPU offload" in line]
    assert len(lines) == 1 and "after step 3" in lines[0], lines
    names = {"master", "remainder", "exp_avg", "exp_avg_sq"}
    before, after = plain.memory_bytes(), opt.memory_bytes()
    freed = sum(before.get(n, 0) - after.get(n, 0) for n in names)
    # (a split key pads each part to the shard alignment: a few elements per key)
    assert abs(freed - plan.device_bytes_saved) <= 16 * 1024 * len(opt.keys), (before, after, plan)
    if plan.fraction > 0:
        assert plan.host_params > 0 and opt.memory_bytes("host")["exp_avg"] > 0
    for a, b in zip(plain_model.parameters(), model.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=6 * 2 * 2**-7, atol=1e-5)


def test_auto_step_is_within_ten_percent_of_no_offload():
    """The target: fraction="auto" on a model that fits without offload takes at most 1.1x the
    step without offload (the best of three 5-step means after the re-plan), and reports the GPU
    memory it saves."""
    width, layers, rows = 2048, 8, 8192
    best, saved = [], None
    for offload in (None, shardopt.CPUOffload(fraction="auto", overlap_backward="auto")):
        model = _gpt_like(width, layers)
        opt = shardopt.DistributedFusedAdam(
            model.parameters(), lr=1e-4, offload=offload, overlap_param_sync=True
        )
        _train_ms(model, opt, 4, rows, width)  # the re-plan after step 3, a step after it
        best.append(min(_train_ms(model, opt, 5, rows, width) for _ in range(3)))
        if offload is not None:
            plan = opt.offload_plan
            saved = plan.device_bytes_saved
            print(f"auto: fraction {plan.fraction:.3f}, {saved / 2**20:.1f} MiB of GPU memory "
                  f"saved; {plan.reason}")  # fmt: skip
        opt.close()
        del model, opt
        torch.cuda.empty_cache()
    plain_ms, auto_ms = best
    print(f"step: no offload {plain_ms:.2f} ms, auto {auto_ms:.2f} ms ({auto_ms / plain_ms:.3f}x)")
    assert saved is not None and saved >= 0
    assert auto_ms <= 1.1 * plain_ms, (plain_ms, auto_ms)
