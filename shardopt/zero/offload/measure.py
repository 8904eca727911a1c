"""CPU offload, ``fraction="auto"``: what is measured on this machine for the decision.

``measure`` times, on rank 0, the CPU kernel's update per element (an Adam update of 2^25
elements on the host with the grads and the out slot in the offloaded keys' dtypes, the thread
budget in effect), the host-device copy per element (the grad down and the param up, in their
dtypes) and the device kernel's update per element.
``BackwardTimer`` times the first steps of training from the grad sync's hooks: the backward
(from its first grad hook to the last grad hook or reduce-scatter launch in it) and the forward
before it (from the end of the last ``step()`` to that first grad hook), with CUDA events on a
CUDA job (GPU time) and ``time.perf_counter`` on a CPU job. ``device_budget`` is the GPU memory
the optimizer state may take after a re-plan. See Note: what auto measures (offload_replan.py).
"""

from __future__ import annotations

import math
import time

import torch

from shardopt import kernels as _ops
from shardopt import state_codec

_MEASURE_NUMEL = 1 << 20
# The CPU update is DRAM-bound only on state larger than the last-level cache: 2^20 elements (16
# MB of fp32 state) ran from a server CPU's cache (up to 320 MB of L3 a socket), and auto took the
# offloaded part's update for faster than it was; 2^25 elements (537 MB with bf16 grads and out
# slot, held only while measuring) stream from memory as a real shard does.
_CPU_MEASURE_NUMEL = 1 << 25
_DEVICE_MEASURE_NUMEL = 1 << 22  # a device kernel on 2^20 elements is mostly launch latency


def _time_ms(fn, device: torch.device, repeat: int = 3) -> float:
    """Best of ``repeat`` timed calls of ``fn`` (after a warm-up), in milliseconds."""
    fn()
    best = math.inf
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def _adam_ms(
    device: torch.device,
    grad_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> float:
    """Per-element time of an Adam update on ``device``: fp32 masters and moments, grads in
    ``grad_dtype``, the new params also written in ``out_dtype`` when given (the offload kernel's
    out slot)."""
    n = _DEVICE_MEASURE_NUMEL if device.type == "cuda" else _CPU_MEASURE_NUMEL
    tensors = [[torch.zeros(n, dtype=grad_dtype, device=device)]]
    tensors += [[torch.zeros(n, dtype=torch.float32, device=device)] for _ in range(3)]
    if out_dtype is not None:
        tensors.append([torch.zeros(n, dtype=out_dtype, device=device)])

    def update() -> None:
        _ops.adam(
            tensors, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1, adam_w_mode=True,
            bias_correction=True, weight_decay=0.0,
        )  # fmt: skip

    return _time_ms(update, device) / n


def measure(device: torch.device, grad_bytes: int, param_bytes: int) -> dict[str, float]:
    """Per-element times (ms) of the CPU update (``cpu_ms``), the copies (``copy_ms``) and the
    device update (``gpu_ms``; the CPU update's on a CPU job)."""
    low = {2: torch.bfloat16, 4: torch.float32}
    cpu = _adam_ms(
        torch.device("cpu"),
        low.get(grad_bytes, torch.float32),
        low[param_bytes] if param_bytes in low and param_bytes < 4 else None,
    )
    n = _MEASURE_NUMEL
    host = torch.empty(n * (grad_bytes + param_bytes), dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()  # the staging slots are page-locked too
    dev = torch.empty_like(host, device=device)
    copy = _time_ms(lambda: (host.copy_(dev), dev.copy_(host)), device) / n
    gpu = _adam_ms(device) if device.type == "cuda" else cpu
    return {"cpu_ms": cpu, "copy_ms": copy, "gpu_ms": gpu}


def state_bytes_per_param(optimizer, params: list[torch.Tensor], storage) -> float:
    """GPU bytes per shard element that offloading frees: the master copy (low-precision
    params) and every state tensor in its format (``storage``: a state_storage.Storage)."""
    master = 4.0 if any(p.dtype != torch.float32 for p in params) else 0.0
    return master + len(optimizer.state_names) * state_codec.bytes_per_element(storage.state_format)


def device_budget(optimizer) -> float:
    """GPU bytes the optimizer state may take after a re-plan (at a step boundary): what is
    free on the device and in the caching allocator, plus the state now on the GPU, less the
    transient peak of a step (the largest allocation seen above what is held now) and 5% of the
    device for fragmentation. Infinite on a CPU job."""
    device = optimizer.device
    if device.type != "cuda":
        return math.inf
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    transient = torch.cuda.max_memory_allocated(device) - allocated
    names = {"master", "remainder", *optimizer.state_names}
    held = 0
    for key in optimizer.keys:
        if not key.buffers.offloaded:
            held += sum(n for name, n in key.buffers.bytes().items() if name in names)
            held += sum(n for name, n in key.buffers.bytes().items() if name.endswith("_scales"))
    return float(free + cached + held - transient - 0.05 * total)


class BackwardTimer:
    """Times the forward and backward of the first steps through the grad sync's callbacks
    (installed over the ones there, which still run; ``remove`` puts them back)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._start = self._end = self._step_end = None
        #: (forward ms or None, backward ms) of each measured step
        self.samples: list[tuple[float | None, float]] = []
        self._installed = None

    def _stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, a, b) -> float:
        if not self.cuda:
            return (b - a) * 1e3
        b.synchronize()
        return float(a.elapsed_time(b))

    def _in_backward(self) -> None:
        stamp = self._stamp()
        if self._start is None:
            self._start = stamp
        self._end = stamp

    def install(self, grad_sync) -> None:
        """Wraps ``grad_sync``'s ``before_sync`` (run by every grad hook, and by the step's
        ``finish``) and ``on_launch`` (every reduce-scatter launched during backward); times
        only synchronised backward passes."""
        before, launched = grad_sync.before_sync, grad_sync.on_launch

        def before_sync() -> None:
            # a grad hook (inside backward) of a synchronised backward (no_sync() micro-batches
            # only accumulate: what the update can overlap is the backward that syncs)
            if grad_sync.enabled and torch._C._current_graph_task_id() != -1:
                self._in_backward()
            if before is not None:
                before()

        def on_launch(key, bucket_index: int, handle) -> None:
            self._in_backward()
            if launched is not None:
                launched(key, bucket_index, handle)

        grad_sync.before_sync, grad_sync.on_launch = before_sync, on_launch
        self._installed = (grad_sync, before, launched)

    def remove(self) -> None:
        if self._installed is not None:
            grad_sync, before, launched = self._installed
            grad_sync.before_sync, grad_sync.on_launch = before, launched
            self._installed = None

    def step_ended(self, measured: bool) -> None:
        """At the end of a step: keeps this step's times when ``measured``, starts the next."""
        if measured and self._start is not None:
            forward = None if self._step_end is None else self._ms(self._step_end, self._start)
            self.samples.append((forward, self._ms(self._start, self._end)))
        self._start = self._end = None
        self._step_end = self._stamp()

    def dropped(self) -> None:
        """``zero_grad()`` outside a step: the backward so far is not a step's."""
        self._start = self._end = None

    def windows(self) -> tuple[float, float]:
        """The median forward and backward of the measured steps (ms; 0 without samples)."""

        def median(values: list[float]) -> float:
            values = sorted(values)
            return values[len(values) // 2] if values else 0.0

        forward = median([f for f, _ in self.samples if f is not None])
        return forward, median([b for _, b in self.samples])
