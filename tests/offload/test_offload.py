"""CPU offload (``offload="cpu"`` / ``shardopt.CPUOffload``) on gloo: the same optimizer with and
without offload gives the same bits.

- Every class, fp32 and bf16 params, with clipping, a GradScaler whose inf on one rank skips the
  step everywhere, accumulation with and without ``no_sync``, unused params, HSDP and every state
  format: params after every step and ``state_dict()`` equal bit for bit (``torch.equal``).
- Checkpoints (shardopt.checkpoint and DCP through ``sharded_state_dict``): saved with offload
  at world 2, resumed without it at world 3 and the reverse, equal to the uninterrupted run.
- A partial fraction keeps the first-registered params on the GPU path; auto is deterministic;
  the planning function is tested as data; bad settings raise on every rank.
- ``memory_bytes()`` reports device and host bytes separately.
- The offload worker thread: with ``overlap_param_sync`` the same bits, ``step()`` returns before
  it is done, a forward waits only for its own buckets, errors in it reach the main thread.
- Updates during backward (``overlap_backward``): the same bits, a bucket updated before backward
  ended, and clipping / GradScaler / a second synchronised backward raising.
One spawn per world runs every case (the suite's runtime matters).
"""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_plan import plan_fixture, plan_params
from torch import nn

import shardopt
from shardopt import checkpoint
from shardopt.zero.layout import Range
from shardopt.zero.offload import host_memory, host_numa
from shardopt.zero.offload import plan as offload_plan
from shardopt.zero.offload.plan import plan_fraction, split_params, thread_budget
from shardopt.zero.offload.worker import Progress, _SwitchInterval

ROOT = "SHARDOPT_TEST_OFFLOAD_ROOT"
BF16 = torch.bfloat16

CLASSES = {
    "Adam": (shardopt.DistributedFusedAdam, dict(lr=0.02, weight_decay=0.05)),
    "LAMB": (shardopt.DistributedFusedLAMB, dict(lr=0.02, max_grad_norm=1.0)),
    "NovoGrad": (shardopt.DistributedFusedNovoGrad, dict(lr=0.02, weight_decay=0.01)),
    "SGD": (shardopt.DistributedFusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "Adagrad": (shardopt.DistributedFusedAdagrad, dict(lr=0.05, weight_decay=0.01)),
}

#: Adam's storage formats: (param dtype, keywords)
FORMATS = {
    "remainders": (BF16, dict(store_param_remainders=True)),
    "scaled_fp16": (BF16, dict(with_scaled_states=True)),
    "int8": (torch.float32, dict(state_format="int8")),
    "remainders_int8": (BF16, dict(store_param_remainders=True, state_format="int8")),
    "bf16_state": (BF16, dict(dtype=BF16)),
    "fp16_state": (torch.float32, dict(state_format="fp16")),
    "fp32_sync_of_bf16": (BF16, dict(param_sync_dtype=torch.float32)),
    "int16_bit_sync": (torch.float32, dict(param_sync_dtype=torch.int16)),
}


class Net(nn.Module):
    """Sizes off every alignment; params straddle buckets; ``unused`` gets no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 300)
        self.b = nn.Linear(300, 5)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def _opt(name, model, offload, dtype_kw=None, **kw):
    cls, hyper = CLASSES[name]
    return cls(
        model.parameters(),
        **{**hyper, **kw},
        bucket_cap_mb=1000 * 4 / 2**20,  # several buckets
        offload=offload,
        **(dtype_kw or {}),
    )


def _backward(model, rank, step, scaler=None, inf=False, solo=False):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 7, generator=gen).to(model.a.weight.dtype)
    loss = model(x).float().pow(2).mean()
    if solo:  # only rank 0's grads count: the summed grads do not depend on the world size
        loss = loss * float(rank == 0)
    if scaler is not None:
        loss = scaler.scale(loss)
    if inf:
        loss = loss * math.inf
    loss.backward()


def _same(a, b, what, tol=None):
    """``a`` and ``b`` (tensors, nested in dicts, lists and tuples) are equal bit for bit; with
    ``tol`` (``torch.testing.assert_close``'s rtol and atol) floating tensors only that close."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype, what
        if tol is not None and a.is_floating_point():
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert set(a) == set(b), (what, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{what}.{k}", tol)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]", tol)
    else:
        assert a == b, (what, a, b)


def _train(model, opt, rank, steps, *, clip=None, scaler=None, accumulate=0, no_sync=False,
           inf_at=None, each=None, solo=False):  # fmt: skip
    for step in steps:
        for micro in range(accumulate):
            if no_sync:
                with opt.no_sync():
                    _backward(model, rank, 1000 + 10 * step + micro)
            else:  # synchronised backward passes accumulate into the grad shard
                _backward(model, rank, 1000 + 10 * step + micro)
        inf = inf_at == step and rank == 0
        if scaler is not None:
            _backward(model, rank, step, scaler=scaler, inf=inf)
            if clip is not None:
                scaler.unscale_(opt)
                opt.clip_grad_norm(clip)
            scaler.step(opt)
            scaler.update()
        else:
            _backward(model, rank, step, inf=inf, solo=solo)
            if clip is not None:
                opt.clip_grad_norm(clip)
            opt.step()
        opt.zero_grad()
        if each is not None:
            each(step)


def _parity(name, rank, *, dtype=torch.float32, dtype_kw=None, offload="cpu", opt_kw=None,
            **train_kw):  # fmt: skip
    """Trains the same model with and without offload; params after every step and the state
    dicts must be equal bit for bit."""
    runs = []
    for off in (None, offload):
        model = _model(dtype)
        opt = _opt(name, model, off, dtype_kw, **(opt_kw or {}))
        scaler = None
        if train_kw.get("scaler"):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        history = []
        kw = dict(train_kw, scaler=scaler)

        def each(step, m=model, o=opt, h=history):
            o.wait_param_sync()  # (overlap_param_sync leaves the all-gathers in flight)
            h.append([p.detach().clone() for p in m.parameters()])

        _train(model, opt, rank, range(4), each=each, **kw)
        runs.append((history, opt.state_dict(), opt))
    (h0, sd0, _), (h1, sd1, opt1) = runs
    for step, (a, b) in enumerate(zip(h0, h1)):
        _same(a, b, f"{name} params after step {step}")
    _same(sd0, sd1, f"{name} state_dict")
    return opt1


def every_class(rank, world):
    for name in CLASSES:
        for dtype in (torch.float32, BF16):
            opt = _parity(name, rank, dtype=dtype)
            assert all(k.buffers.offloaded for k in opt.keys)


def staging_ring(rank, world):
    """One staging slot (no transfer ahead) and two: the same bits; SGD (its momentum flag is a
    per-step value) goes bucket by bucket too; a rule with all-reduced per-tensor norms (LAMB,
    NovoGrad) takes the whole-shard path, also the same bits."""
    for slots in (1, 2):
        _parity("Adam", rank, dtype=BF16, offload=shardopt.CPUOffload(staging_slots=slots))
    # dampening: the first step's momentum rule (buffer = grad) differs from the later ones
    sgd = dict(nesterov=False, dampening=0.3)
    _parity("SGD", rank, dtype=BF16, offload=shardopt.CPUOffload(staging_slots=1), opt_kw=sgd)
    assert shardopt.DistributedFusedAdam.bucketwise_update
    assert shardopt.DistributedFusedSGD.bucketwise_update
    assert not shardopt.DistributedFusedLAMB.bucketwise_update
    assert not shardopt.DistributedFusedNovoGrad.bucketwise_update


def kept_views(rank, world):
    """Note: views kept for the update thread (flat_buffer.py): once each bucket has met each
    staging slot, no update on the update thread calls a torch view op (each would release and
    retake the GIL), the same view objects are handed out step after step, the bits are as
    without offload (``_parity``), and a whole-shard update's per-step staged grads are never
    kept (they would stay alive)."""
    calls = {"narrow": 0, "reshape": 0, "to": 0, "view": 0}
    originals = {name: getattr(torch.Tensor, name) for name in calls}

    def counting(name):
        def op(self, *args, **kwargs):
            if threading.current_thread().name == "shardopt-update":
                calls[name] += 1
            return originals[name](self, *args, **kwargs)

        return op

    opt = _parity("Adam", rank, dtype=BF16)
    bufs = [k.buffers for k in opt.keys if k.buffers.offloaded]
    kept = [dict(b._views) for b in bufs]
    assert all(kept), "no view was kept"
    for name in calls:
        setattr(torch.Tensor, name, counting(name))
    try:
        model = _model(BF16)
        opt = _opt("Adam", model, "cpu")
        # a ring of S slots meets each bucket in each slot within S steps (4: the default)
        _train(model, opt, rank, range(4))
        opt.wait_param_sync()
        first = [{tag: [id(v) for v in views] for tag, (_, views) in b._views.items()}
                 for b in (k.buffers for k in opt.keys if k.buffers.offloaded)]  # fmt: skip
        for name in calls:
            calls[name] = 0
        _train(model, opt, rank, range(4, 8))
        opt.wait_param_sync()
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    assert calls == dict.fromkeys(calls, 0), f"torch ops on the update thread: {calls}"
    again = [{tag: [id(v) for v in views] for tag, (_, views) in b._views.items()}
             for b in (k.buffers for k in opt.keys if k.buffers.offloaded)]  # fmt: skip
    assert again == first, "the views were made again"
    for b in (k.buffers for k in opt.keys if k.buffers.offloaded):
        assert all(b._keeps(shard) for shard, _ in b._views.values())
    # a shard made for one call is not kept: fresh views each time
    buf = bufs[0]
    per_call = torch.zeros(buf.layout.shard_numel)
    r = [Range(0, 4)]
    assert buf.views(per_call, r)[0] is not buf.views(per_call, r)[0]
    assert buf.views(buf.master, r)[0] is buf.views(buf.master, r)[0]
    lamb = _parity("LAMB", rank, dtype=BF16)  # the whole-shard path: grads staged per step
    for key in lamb.keys:
        views = key.buffers._views
        assert views and all(key.buffers._keeps(shard) for shard, _ in views.values())


def _host_tensors(opt):
    """Every host tensor of an offloaded optimizer: state of its keys and staging slots."""
    out = []
    for key in opt.keys:
        buf = key.buffers
        out += [t for t in (buf.master, buf.remainder) if torch.is_tensor(t)]
        out += [*buf.state.values(), *buf.scales.values()]
    pipeline = opt._offload_pipeline
    if pipeline is not None:
        for ring in (pipeline.grad_slots, pipeline.out_slots, pipeline.param_slots):
            out += [b for slots in ring.values() for b in slots.buffers]
    return out


def huge_pages(rank, world):
    """Host state and staging slots in huge-page mappings (the size threshold lowered so this
    model's tensors take them) and on torch's allocator (``huge_pages=False``): the same bits as
    without offload, for the bucketwise path (Adam), a compact format and the whole-shard path
    (LAMB)."""
    from shardopt.zero.offload import host_memory

    before = host_memory.MIN_BYTES
    host_memory.MIN_BYTES = 1
    try:
        for huge in (True, False):
            off = shardopt.CPUOffload(huge_pages=huge)
            compact = dict(store_param_remainders=True, state_format="int8")
            for name, dtype, kw in (("Adam", BF16, None), ("Adam", BF16, compact),
                                    ("LAMB", torch.float32, None)):  # fmt: skip
                opt = _parity(name, rank, dtype=dtype, dtype_kw=kw, offload=off)
                host = _host_tensors(opt)
                assert host and all(t.device.type == "cpu" for t in host)
                for t in host:
                    extra = t.untyped_storage().nbytes() - t.numel() * t.element_size()
                    if huge:  # its own mapping, starting at one of OFFSETS into a huge page
                        start = t.data_ptr() % host_memory.HUGE_PAGE
                        assert start in host_memory.OFFSETS, (name, t.shape, start)
                        assert extra == start + host_memory.HUGE_PAGE, (name, t.shape, extra)
                    else:
                        assert extra == 0, (name, t.shape, extra)
    finally:
        host_memory.MIN_BYTES = before


def clipping_and_scaler(rank, world):
    for name in CLASSES:
        _parity(name, rank, clip=0.5)
        _parity(name, rank, dtype=BF16, scaler=True, clip=0.5, inf_at=1)


def accumulation(rank, world):
    for name in ("Adam", "LAMB", "SGD"):
        _parity(name, rank, accumulate=1, no_sync=False)
        _parity(name, rank, dtype=BF16, accumulate=2, no_sync=True)
    _parity("Adam", rank, dtype=BF16, opt_kw=dict(overlap_param_sync=True), clip=1.0)


class SlowAdam(shardopt.DistributedFusedAdam):
    """Adam whose offloaded bucket updates (on the offload worker thread) take ``delay`` s."""

    delay = 0.0
    fail_on_rank: int | None = None
    #: (thread name, start, end) of each offloaded bucket's update
    spans: list = []

    def _update(self, scalars):
        worker = threading.current_thread() is not threading.main_thread()
        if worker and self.fail_on_rank in (self.sharded.rank, -1):
            raise ValueError("boom in the worker")
        start = time.perf_counter()
        if worker:
            time.sleep(self.delay)
        super()._update(scalars)
        if worker:
            self.spans.append((threading.current_thread().name, start, time.perf_counter()))


def _overlapped(name, dtype, offload, rank, steps=4):
    """Trains with ``overlap_param_sync=True``, a scheduler halving lr right after each step
    (while the worker may still run that step); the params after every other step and the state
    dict."""
    model = _model(dtype)
    opt = _opt(name, model, offload, overlap_param_sync=True)
    history = []
    for step in range(steps):
        _backward(model, rank, step)  # the forward waits bucket by bucket (pre-hooks)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.5  # seen by the next step only
        opt.zero_grad()
        if step % 2:
            opt.wait_param_sync()
            history.append([p.detach().clone() for p in model.parameters()])
    return history, opt.state_dict(), opt


def _kept_calls(opt):
    """Note: planned calls are kept: without skipped params the same Call objects come back (a
    bucket's window too), equal to a fresh plan; with a skipped param they are planned anew."""
    opt.wait_param_sync()
    calls = opt.update_calls
    saved = calls.unused, list(calls.offsets)
    calls.unused, calls.offsets = frozenset(), [0] * len(calls.offsets)  # nothing skipped
    try:
        _kept_calls_of(calls, opt.keys)
    finally:
        calls.unused, calls.offsets = saved


def _kept_calls_of(calls, keys):
    for key in keys:
        first, again = calls.calls(key, False), calls.calls(key, False)
        assert first and all(a is b for a, b in zip(first, again, strict=True))
        assert first == calls._planned(key, False)
        bucket = key.layout.buckets[-1]
        shard = Range(bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel)
        with calls.within(key, shard):
            one, two = calls.calls(key, False), calls.calls(key, False)
        assert one and all(a is b for a, b in zip(one, two, strict=True))
        ranges = [r for c in one for r in c.shard_ranges]
        assert all(r.start >= shard.start and r.end <= shard.end for r in ranges)
        skipped = key.buffers.fragments[0].param
        calls.offsets[skipped] += 1  # a param that skipped a step: planned per step
        try:
            fresh = calls.calls(key, False)
            assert not any(a is b for a in fresh for b in first)
            assert {c.offset for c in fresh} == ({0, 1} if len(key.buffers.fragments) > 1 else {1})
        finally:
            calls.offsets[skipped] -= 1
        assert all(a is b for a, b in zip(calls.calls(key, False), first, strict=True))


def worker(rank, world):
    """The offload worker thread: with overlap_param_sync the same bits as without offload
    (Adam bf16 and Adagrad fp32, lr changed right after step); step() returns before the worker
    is done and a forward waits only for its own buckets; the updates run on the update thread
    back to back, the worker's part of each bucket beside the next one's update; the threads
    stop on close(); an error in an update is raised on the main thread (on every rank at the
    next sync point, and no rank hangs when only one rank's worker fails). While a worker runs,
    the switch interval is at most CPUOffload.switch_interval's."""
    for name, dtype in (("Adam", BF16), ("Adagrad", torch.float32)):
        h0, sd0, _ = _overlapped(name, dtype, None, rank)
        h1, sd1, opt = _overlapped(name, dtype, "cpu", rank)
        _same(h0, h1, f"{name} params with overlap")
        _same(sd0, sd1, f"{name} state_dict with overlap")
        assert opt._offload_pipeline.worker.alive
        assert sys.getswitchinterval() <= 2e-4 * (1 + 1e-9)
        _kept_calls(opt)
        opt.close()
        assert not opt._offload_pipeline.worker.alive
    model = _model(BF16)
    opt = SlowAdam(model.parameters(), lr=0.01, bucket_cap_mb=1000 * 4 / 2**20, offload="cpu",
                   overlap_param_sync=True)  # fmt: skip
    _backward(model, rank, 0)
    opt.delay = 0.4
    pipeline = opt._offload_pipeline
    finish = pipeline._finish

    def slow_finish(*args, **kwargs):  # the worker's part of a bucket after its update
        finish(*args, **kwargs)
        time.sleep(0.3)

    pipeline._finish = slow_finish
    opt.spans = []
    opt.step()
    sync = opt.param_sync
    progress = sync.progress
    assert progress is not None and not progress.finished, "step() waited for the worker"
    buckets = len(progress.order)
    assert buckets > 2
    model.a(torch.zeros(1, 7, dtype=BF16))  # the first layer: only its buckets are waited for
    assert 0 < sync._issued < buckets, (sync._issued, buckets)
    opt.wait_param_sync()
    assert sync.progress is None and not sync.busy
    # Note: the update thread: every update ran there, one right after the other: the worker's
    # part of a bucket (0.3 s here) ran while the next bucket's update (0.4 s) did, not between
    assert len(opt.spans) == buckets and {n for n, *_ in opt.spans} == {"shardopt-update"}
    gaps = [b[1] - a[2] for a, b in zip(opt.spans, opt.spans[1:])]
    assert max(gaps) < 0.15, gaps
    pipeline._finish = finish
    opt.delay = 0.0
    for overlap in (False, True):
        for failing in (-1, world - 1):
            model = _model(BF16)
            opt = SlowAdam(model.parameters(), lr=0.01, bucket_cap_mb=1000 * 4 / 2**20,
                           offload="cpu", overlap_param_sync=overlap)  # fmt: skip
            _backward(model, rank, 0)
            opt.fail_on_rank = failing
            fails = failing in (-1, rank)
            try:
                opt.step()
                opt.wait_param_sync()
            except RuntimeError as e:
                assert fails, e
                assert "offload worker" in str(e), e
                cause = e.__cause__
                assert isinstance(cause, ValueError) and "boom" in str(cause)
                frames = [f.name for f in traceback.extract_tb(cause.__traceback__)]
                assert "_update" in frames, frames
            else:
                assert not fails, "the worker's error was lost"
            opt.close()


class NetC(nn.Module):
    """``c`` gets a grad on rank 0 only (a bucket with a param unused on the other ranks);
    ``slow`` makes the backward of the first layer (the last grads) take a while."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.a = nn.Linear(7, 300)
        self.b = nn.Linear(300, 5)
        self.c = nn.Linear(5, 5)

    def forward(self, x, use_c):
        h = _Slow.apply(self.a(x), self.delay)
        y = self.b(torch.tanh(h))
        return self.c(y) if use_c else y


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.delay)
        return g, None


def _early_run(name, dtype, offload, rank, steps=4):
    torch.manual_seed(0)
    model = NetC().to(dtype)
    sgd = dict(nesterov=False, dampening=0.3) if name == "SGD" else {}  # (see staging_ring)
    opt = _opt(name, model, offload, **sgd)
    early = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 7, generator=gen).to(dtype)
        model(x, use_c=rank == 0).float().pow(2).mean().backward()
        if offload is not None:
            early.append(len(opt._offload_pipeline.early.done))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict(), early


def backward_overlap(rank, world):
    """CPUOffload(overlap_backward=True/"auto"): the same bits as without offload (Adam bf16,
    Adagrad fp32, SGD with momentum, a param unused on some ranks), buckets really updated
    before step() and before backward ended; clipping, a GradScaler and a second synchronised
    backward raise on every rank (what follows such an error, a zero_grad() between backward and
    step() and state I/O there: test_offload_backward.py)."""
    for name, dtype in (("Adam", BF16), ("Adagrad", torch.float32), ("SGD", BF16)):
        p0, sd0, _ = _early_run(name, dtype, None, rank)
        for mode in (True, "auto"):
            p1, sd1, early = _early_run(name, dtype, shardopt.CPUOffload(overlap_backward=mode),
                                        rank)  # fmt: skip
            _same(p0, p1, f"{name} {mode} params")
            _same(sd0, sd1, f"{name} {mode} state_dict")
            assert all(early[1:]) and bool(early[0]) == (mode is True), early
    # the update of the last layers' buckets finishes before the first layer's backward does
    torch.manual_seed(0)
    model = NetC(delay=0.5)
    opt = _opt("Adam", model, shardopt.CPUOffload(overlap_backward=True))
    ends, stamps = [], []
    model.a.weight.register_post_accumulate_grad_hook(lambda p: ends.append(time.perf_counter()))
    publish = Progress.publish

    def stamped(self, bucket_id, event):
        stamps.append(time.perf_counter())  # the worker: a bucket's update is done
        publish(self, bucket_id, event)

    Progress.publish = stamped
    try:
        model(torch.randn(6, 7), use_c=True).pow(2).mean().backward()
        assert opt._offload_pipeline.early.done
        opt.step()
        opt.wait_param_sync()
    finally:
        Progress.publish = publish
    assert stamps and min(stamps) < max(ends), (stamps, ends)
    opt.close()
    # misuse, each raising on every rank
    for mode in (True, "auto"):
        for misuse in ("clip", "scaler", "second_backward"):
            torch.manual_seed(0)
            model = NetC()
            opt = _opt("Adam", model, shardopt.CPUOffload(overlap_backward=mode))
            if mode == "auto":  # a clean step turns it on
                model(torch.randn(6, 7), use_c=True).pow(2).mean().backward()
                opt.step()
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if misuse == "scaler" else None
            loss = model(torch.randn(6, 7), use_c=True).pow(2).mean()
            (scaler.scale(loss) if scaler else loss).backward()
            if misuse == "second_backward":
                model(torch.randn(6, 7), use_c=True).pow(2).mean().backward()
            with pytest.raises(RuntimeError, match=r"overlap_backward=False"):
                if misuse == "clip":
                    opt.clip_grad_norm(1.0)
                    opt.step()
                elif misuse == "scaler":
                    scaler.step(opt)
                else:
                    opt.step()
            opt.close()
    off = shardopt.CPUOffload(overlap_backward=False)
    _parity("Adam", rank, offload=off, clip=0.5)  # off: clipping stays exact


def state_formats(rank, world):
    for dtype, kw in FORMATS.values():
        _parity("Adam", rank, dtype=dtype, dtype_kw=kw, clip=1.0)
        _parity("Adam", rank, dtype=dtype, dtype_kw=kw, scaler=True, inf_at=2)


def hsdp(rank, world):
    groups = shardopt.zero.hsdp_groups(2)
    for name in ("Adam", "NovoGrad"):
        _parity(name, rank, dtype=BF16, opt_kw=groups._asdict(), clip=1.0)


def partial_fraction(rank, world):
    """fraction=0.5: the first-registered params keep the GPU path, the rest are offloaded; an
    elementwise rule without clipping gives the bits of no offload, the others agree closely."""
    for name in ("Adam", "SGD"):
        opt = _parity(name, rank, dtype=BF16, offload=shardopt.CPUOffload(fraction=0.5))
        flags = [(k.buffers.offloaded, k.layout.params) for k in opt.keys]
        assert [f for f, _ in flags] == [True, False], flags
        host, device = flags[0][1], flags[1][1]
        assert max(device) < min(host)  # the first-registered stay on the GPU
        plan = opt.offload_plan
        assert plan.fraction == 0.5 and plan.host_params == len(host)
        assert plan.device_params == len(device)
    opt = _opt("LAMB", _model(BF16), shardopt.CPUOffload(fraction=0.0))
    assert not any(k.buffers.offloaded for k in opt.keys)
    assert opt.memory_bytes("host") == {}


def auto_fraction(rank, world):
    """On a CPU job the device is the host: auto offloads nothing, on every rank alike (the
    re-plan after the first steps is tested in test_offload_auto.py)."""
    model = _model(torch.float32)
    opt = _opt("Adam", model, shardopt.CPUOffload(fraction="auto"))
    plan = opt.offload_plan
    assert plan.requested == "auto" and plan.fraction == 0.0, plan
    assert plan.reason.startswith("auto at construction: "), plan
    everyone = [None] * world
    dist.all_gather_object(everyone, (plan.fraction, plan.reason))
    assert all(e == everyone[0] for e in everyone)
    _train(model, opt, rank, range(2))


def memory_split(rank, world):
    for dtype in (torch.float32, BF16):
        plain = _opt("Adam", _model(dtype), None)
        off = _opt("Adam", _model(dtype), "cpu")
        dev, host = off.memory_bytes(), off.memory_bytes("host")
        assert off.memory_bytes(where="device") == dev and plain.memory_bytes("host") == {}
        assert dev["param_space"] == plain.memory_bytes()["param_space"]
        assert dev["master"] == 0 and "exp_avg" not in dev
        shard = sum(k.layout.shard_numel for k in off.keys)
        (key,) = off.keys
        chunk = max(b.chunk_numel for b in key.layout.buckets)
        # exact-size slots: grads in their sync dtype (fp32 here), params out in theirs (a bf16
        # key's fp32 master writes bf16 params into its out slots; fp32 params come down into
        # slots of their own, for their host copy to take them, and are updated in that copy,
        # no out slot: Note: the offloaded step)
        staging = 4 * chunk * (4 + (2 if dtype == BF16 else 4))
        # a separate fp32 host master, for fp32 params too
        assert host == {"master": shard * 4, "exp_avg": shard * 4, "exp_avg_sq": shard * 4,
                        "staging": staging}, (host, staging)  # fmt: skip
        assert off._offload_pipeline.pinned_bytes() == 0  # a CPU job pins nothing
    # remainders + int8 moments: no host copy of the bf16 params (staged per bucket), int16
    # remainders and 8-bit codes with a scale per block: about 4.03 B/param
    dtype, kw = FORMATS["remainders_int8"]
    off = _opt("Adam", _model(dtype), "cpu", kw)
    (key,) = off.keys
    shard = key.layout.shard_numel
    host = off.memory_bytes("host")
    blocks = 4 * -(-shard // 256)
    assert host["master"] == 0 and host["remainder"] == 2 * shard
    assert host["exp_avg"] == host["exp_avg_sq"] == shard
    assert host["exp_avg_scales"] == host["exp_avg_sq_scales"] == blocks
    chunk = max(b.chunk_numel for b in key.layout.buckets)
    assert host["staging"] == 4 * chunk * (4 + 2)  # fp32 grads and bf16 params, no out slot
    with pytest.raises(ValueError, match="where"):
        off.memory_bytes("gpu")


def _changed(**fields) -> shardopt.CPUOffload:
    """A CPUOffload whose fields were set past its checks (``object.__setattr__``)."""
    offload = shardopt.CPUOffload()
    for name, value in fields.items():
        object.__setattr__(offload, name, value)
    return offload


def refusals(rank, world):
    """What only the build can check (a NUMA node of this host, threads above its CPUs, fields
    set past the constructor's checks) raises there, naming the optimizer; on one rank only,
    every rank raises."""
    model = _model(torch.float32)
    cases = [
        ("gpu", ValueError, "offload must be"),
        (3, TypeError, "offload must be"),
        (shardopt.CPUOffload(numa_node=4095), ValueError, "NUMA node 4095 has no CPU"),
        (shardopt.CPUOffload(threads=offload_plan.max_threads() + 1), ValueError, "at most"),
        (_changed(fraction=1.5), ValueError, "Adam: CPUOffload.fraction must be in"),
        (_changed(staging_slots=0), ValueError, "Adam: CPUOffload.staging_slots"),
    ]
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            _opt("Adam", model, bad)
    # wrong on one rank only: every rank raises (no hang)
    with pytest.raises((ValueError, RuntimeError), match="offload must be"):
        _opt("SGD", model, "gpu" if rank == 0 else "cpu")
    with pytest.raises(ValueError, match="capturable"):
        _opt("Adam", model, "cpu", capturable=True, skip_unused_params=False)


def numa(rank, world):
    """CPUOffload(numa_node=0) (node 0 is on every Linux host): the same bits as without
    offload; the plan names the node, the host state's pages prefer it, and the update thread
    runs on its CPUs that the process could use at construction, not the worker's CPUs; the
    default ("auto") places nothing for a CPU job (Note: NUMA placement)."""
    nodes = host_numa.node_cpus()
    assert 0 in nodes, nodes
    _parity("Adam", rank, dtype=BF16, offload=shardopt.CPUOffload(numa_node=0))
    everywhere = os.sched_getaffinity(0)
    narrow = {min(nodes[0] & everywhere)}  # one CPU: unlike what the threads inherit

    def build(offload):  # state tensors of many pages (a page is checked inside each)
        torch.manual_seed(0)
        model = nn.Linear(256, 256).to(BF16)
        return model, shardopt.DistributedFusedAdam(model.parameters(), offload=offload)

    os.sched_setaffinity(0, narrow)
    try:
        model, opt = build(shardopt.CPUOffload(numa_node=0))
    finally:
        os.sched_setaffinity(0, everywhere)
    assert opt.offload_plan.numa_node == 0 and opt.offload_plan.threads == 1
    for _ in range(2):
        model(torch.ones(4, 256, dtype=BF16)).float().pow(2).mean().backward()
        opt.step()
    opt.wait_param_sync()
    key = next(k for k in opt.keys if k.buffers.offloaded)
    for t in (key.buffers.master, *key.buffers.state.values()):
        assert host_numa.policy_of(t) == (host_numa.MPOL_PREFERRED, {0})
    worker = opt._offload_pipeline.worker
    assert os.sched_getaffinity(worker._updater[0].native_id) == narrow
    assert os.sched_getaffinity(worker._thread[0].native_id) == everywhere
    opt.close()
    _, plain = build("cpu")  # "auto" on a CPU job: no device node, so nothing placed
    assert plain.offload_plan.numa_node is None
    key = next(k for k in plain.keys if k.buffers.offloaded)
    assert host_numa.policy_of(key.buffers.state["exp_avg"])[0] == 0  # MPOL_DEFAULT


def _ckpt_opt(model, offload, kw):
    return _opt("Adam", model, offload, kw, average_grad_sync=False)


def _ckpt_run(model, opt, rank, steps):
    # clip_grad_norm runs (the step waits for the norm) but never clips: a clip coefficient
    # below 1 depends on the norm's summation order, which differs between world sizes, and the
    # resumed runs are compared bit for bit across them
    _train(model, opt, rank, steps, clip=1e6, solo=True)


def save_w2(rank, world):
    """Checkpoints saved at world 2: with offload and without, sharded and DCP."""
    import torch.distributed.checkpoint as dcp

    root = Path(os.environ[ROOT])
    for tag, off in (("off", "cpu"), ("plain", None)):
        for fmt in ("fp32", "remainders_int8"):
            dtype, kw = (torch.float32, {}) if fmt == "fp32" else FORMATS[fmt]
            model = _model(dtype)
            opt = _ckpt_opt(model, off, kw)
            _ckpt_run(model, opt, rank, range(2))
            checkpoint.save(root / f"{tag}-{fmt}", opt, model)
            sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict(model)}
            dcp.save(sd, checkpoint_id=str(root / f"dcp-{tag}-{fmt}"))
            _ckpt_run(model, opt, rank, range(2, 4))
            if rank == 0 and off is None:
                torch.save(model.state_dict(), root / f"final-{fmt}.pt")


def resume_w3(rank, world):
    """World 3 resumes each world-2 checkpoint with the other offload setting (and the same),
    bit-identical to the uninterrupted run without offload."""
    import torch.distributed.checkpoint as dcp

    root = Path(os.environ[ROOT])
    for fmt in ("fp32", "remainders_int8"):
        dtype, kw = (torch.float32, {}) if fmt == "fp32" else FORMATS[fmt]
        expected = torch.load(root / f"final-{fmt}.pt", weights_only=True)
        for saved in ("off", "plain"):
            for off in ("cpu", None):
                for how in ("sharded", "dcp"):
                    model = _model(dtype, seed=5)
                    opt = _ckpt_opt(model, off, kw)
                    if how == "sharded":
                        checkpoint.load(root / f"{saved}-{fmt}", opt, model)
                    else:
                        sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict(model)}
                        dcp.load(sd, checkpoint_id=str(root / f"dcp-{saved}-{fmt}"))
                        model.load_state_dict(sd["model"])
                        opt.load_sharded_state_dict(sd["optim"], model)
                    _ckpt_run(model, opt, rank, range(2, 4))
                    for k, v in model.state_dict().items():
                        assert torch.equal(v, expected[k]), (fmt, saved, off, how, k)


def state_dict_round_trip(rank, world):
    """A state dict of an offloaded optimizer loads into one without offload and back."""
    for name in ("Adam", "NovoGrad", "SGD"):
        model = _model(BF16)
        opt = _opt(name, model, "cpu")
        _train(model, opt, rank, range(2))
        sd = opt.state_dict()
        for off in (None, "cpu"):
            other = _opt(name, _model(BF16, seed=3), off)
            for p, q in zip(other.all_params, opt.all_params):
                with torch.no_grad():
                    p.copy_(q)
            other.load_state_dict(sd)
            _same(other.state_dict(), sd, f"{name} reloaded (offload={off})")


PLAN = [
    (
        1,
        [
            every_class,
            staging_ring,
            huge_pages,
            partial_fraction,
            auto_fraction,
            memory_split,
            refusals,
            worker,
            backward_overlap,
        ],
    ),  # fmt: skip
    (
        2,
        [
            every_class,
            clipping_and_scaler,
            accumulation,
            hsdp,
            save_w2,
            state_dict_round_trip,
            worker,
            kept_views,
            backward_overlap,
        ],
    ),  # fmt: skip
    (
        3,
        [
            state_formats,
            staging_ring,
            huge_pages,
            partial_fraction,
            resume_w3,
            refusals,
            worker,
            numa,
            backward_overlap,
        ],
    ),  # fmt: skip
    (4, [clipping_and_scaler, hsdp, auto_fraction]),
]


results = plan_fixture(PLAN, ROOT, timeout=600)


@plan_params(PLAN)
def test_offload(results, world, case):
    results.check(world, case)


def test_numa_placement_as_data(tmp_path):
    """Note: NUMA placement: which node and CPUs, from sysfs-like data."""
    assert host_numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert host_numa.parse_cpulist("\n") == set()
    for n, cpus in ((0, "0-1"), (1, "2-3"), (2, "")):  # node 2: memory only
        (tmp_path / "devices/system/node" / f"node{n}").mkdir(parents=True)
        (tmp_path / "devices/system/node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    two = host_numa.node_cpus(tmp_path)
    assert two == {0: {0, 1}, 1: {2, 3}}
    cuda, cpu, every = torch.device("cuda", 0), torch.device("cpu"), {0, 1, 2, 3}

    def place(requested, device=cuda, ranks=2, nodes=two, node=1, allowed=every, dev=(0, 1)):
        return host_numa.placement(
            requested, device, ranks, nodes=nodes, node=node, allowed=allowed,
            device_nodes=list(dev),
        )  # fmt: skip

    Placement = host_numa.Placement
    assert place("auto") == Placement(1, frozenset({2, 3}), 2)
    assert place("auto", allowed={0, 1, 3}) == Placement(1, frozenset({3}), 1)
    # both local ranks' GPUs on node 1: its two CPUs shared, one thread each
    assert place("auto", dev=(1, 1)) == Placement(1, frozenset({2, 3}), 1)
    # four ranks, devices not all visible: spread evenly, two ranks a node
    assert place("auto", ranks=4, dev=(1,)) == Placement(1, frozenset({2, 3}), 1)
    assert place("auto", ranks=1) is None  # one rank keeps every node
    assert place("auto", nodes={0: every}) is None  # one node
    assert place("auto", node=None, device=cpu) is None  # a CPU job: no device node
    assert place("auto", allowed={0, 1}) is None  # none of its CPUs usable: nothing placed
    assert place(None) is None
    assert place(0, ranks=1, device=cpu, node=None, dev=()) == Placement(0, frozenset({0, 1}), 2)
    with pytest.raises(ValueError, match="NUMA node 1 has no CPU"):
        place(1, allowed={0})
    assert host_numa.device_node(cpu) is None


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64") or not sys.platform.startswith("linux"),
    reason="mbind/get_mempolicy syscall numbers are known for Linux x86-64 and arm64",
)
def test_host_tensors_prefer_the_node_they_are_allocated_on():
    """host_memory.on_node: pages preferred on the node before their first touch, else the
    default policy."""
    for huge in (False, True):
        with host_memory.on_node(0):
            t = host_memory.full(1 << 20, torch.float32, 0.0, huge)
        assert host_numa.policy_of(t) == (host_numa.MPOL_PREFERRED, {0})
        u = host_memory.full(1 << 20, torch.float32, 0.0, huge)
        assert host_numa.policy_of(u)[0] == 0  # MPOL_DEFAULT


def test_split_params_takes_the_last_registered():
    assert split_params([10, 10, 10, 10], 1.0) == 0
    assert split_params([10, 10, 10, 10], 0.0) == 4
    assert split_params([10, 10, 10, 10], 0.5) == 2  # the last two offloaded
    assert split_params([10, 10, 10, 10], 0.3) == 3  # 10 of 40 is nearest to 12
    assert split_params([100, 1, 1], 0.5) == 1  # 2 of 102 is nearer than 102 of 102
    assert split_params([], 0.5) == 0


def test_plan_fraction_as_data():
    gib = 2.0**30
    base = dict(numel=10**9, device_bytes_per_param=12.0, cpu_ms_per_param=1e-6,
                copy_ms_per_param=2e-7, gpu_ms_per_param=5e-8)  # fmt: skip
    # a third of the state fits: offload the rest (the smallest fraction that fits)
    f, _ = plan_fraction(**base, free_device_bytes=4e9, window_ms=0.0)
    assert f == pytest.approx(1 - 4e9 / 12e9)
    # a long window hides the whole CPU update (1200 ms): offload everything
    f, _ = plan_fraction(**base, free_device_bytes=100 * gib, window_ms=2000.0)
    assert f == 1.0
    # nothing fits on the GPU
    f, _ = plan_fraction(**base, free_device_bytes=0.0, window_ms=0.0)
    assert f == 1.0
    assert plan_fraction(**dict(base, numel=0), free_device_bytes=0.0, window_ms=0.0)[0] == 1.0
    # (the time model itself: tests/offload/test_offload_auto.py)


@pytest.mark.parametrize(
    "cores, local, want",
    [(16, "1", 15), (16, "2", 7), (16, "4", 3), (16, "8", 2), (16, "32", 1), (3, "1", 3),
     (2, "", 2), (16, "x", 15)],
)  # fmt: skip
def test_thread_budget_splits_the_cores(monkeypatch, cores, local, want):
    """The cores split among the local ranks, one left for the rank's launching thread where a
    rank has four or more."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert thread_budget(3) == 3
    assert thread_budget(None, {"LOCAL_WORLD_SIZE": local} if local else {}) == want


def test_switch_interval_is_lowered_while_workers_run_and_put_back():
    """Note: the worker and the GIL: the smallest interval asked for is in effect while any
    worker holds one; the previous value is back after the last release, unless it was changed
    meanwhile by someone else."""
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        si = _SwitchInterval()
        si.acquire(2e-4)
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        si.acquire(1e-3)  # larger: the smaller one stays
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        si.acquire(1e-4)
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        si.release()
        si.release()
        assert sys.getswitchinterval() == pytest.approx(1e-4)  # one holder left
        si.release()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        si.acquire(2e-4)
        sys.setswitchinterval(0.01)  # the user's own change wins
        si.release()
        assert sys.getswitchinterval() == pytest.approx(0.01)
        si.acquire(0.02)  # never raised
        assert sys.getswitchinterval() == pytest.approx(0.01)
        si.release()
        assert sys.getswitchinterval() == pytest.approx(0.01)
    finally:
        sys.setswitchinterval(saved)


MAX_SLOTS = offload_plan.MAX_STAGING_SLOTS
#: CPUOffload(**kwargs) -> (exception, the field its message names)
CONSTRUCTION_REFUSALS = [
    (dict(fraction=1.5), ValueError, "fraction must be in"),
    (dict(fraction="most"), TypeError, "fraction must be a float"),
    (dict(fraction=True), TypeError, "fraction must be a float"),
    (dict(threads=0), ValueError, "threads must be"),
    (dict(threads=2.0), ValueError, "threads must be"),
    (dict(staging_slots=0), ValueError, "staging_slots must be"),
    (dict(staging_slots=MAX_SLOTS + 1), ValueError, "staging_slots must be .* at most 16"),
    (dict(overlap_backward="yes"), ValueError, "overlap_backward must be"),
    (dict(pin_memory="yes"), TypeError, "pin_memory must be a bool"),
    (dict(huge_pages=1), TypeError, "huge_pages must be a bool"),
    (dict(switch_interval=0), ValueError, "switch_interval must be"),
    (dict(switch_interval="short"), ValueError, "switch_interval must be"),
    (dict(numa_node=-1), ValueError, "numa_node must be"),
    (dict(numa_node="near"), ValueError, "numa_node must be"),
]


@pytest.mark.parametrize("kwargs,exc,match", CONSTRUCTION_REFUSALS, ids=lambda v: str(v))
def test_cpu_offload_checks_its_fields_at_construction(kwargs, exc, match):
    """No process group needed: the dataclass itself refuses, naming the field."""
    with pytest.raises(exc, match=f"^CPUOffload\\.{match}"):
        shardopt.CPUOffload(**kwargs)


def test_cpu_offload_bounds_are_accepted():
    """The largest values the constructor allows (threads' host bound is the build's)."""
    c = shardopt.CPUOffload(fraction=0, staging_slots=MAX_SLOTS, threads=10**6, numa_node=None)
    assert (c.fraction, c.staging_slots, c.threads) == (0, MAX_SLOTS, 10**6)
    assert (
        shardopt.CPUOffload(overlap_backward="auto", switch_interval=None).switch_interval is None
    )


def test_public_api():
    assert "CPUOffload" in shardopt.__all__
    c = shardopt.CPUOffload()
    assert (c.fraction, c.pin_memory, c.threads, c.staging_slots) == (1.0, True, None, 4)
    assert c.huge_pages is False and c.switch_interval == 2e-4
    with pytest.raises(AttributeError):
        c.fraction = 0.5  # frozen
