"""CPU offload at construction: the fraction every rank uses, the thread budget, the plan's log.

``fraction="auto"`` is decided here, before the keys are planned, from measurements taken on this
machine at construction (``measure``): the CPU kernel's update time per element (an Adam update
of 2^20 fp32 elements on the host, the thread budget in effect), the host-device copy time per
element (the grad down and the param up, in their dtypes), the device kernel's time and the
free device memory. The backward pass has not run yet, so the window the CPU update could hide
in is taken as zero: auto keeps on the GPU as much state as the free GPU memory holds when the
GPU update is the faster, and offloads only what does not fit (see ``plan_fraction``). Rank 0
measures and decides; every rank takes its decision (the key split must be the same everywhere).
On a CPU job the device is the host: nothing is short of memory and the host path only adds
copies, so auto deterministically offloads nothing (fraction 0).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from shardopt import kernels as _ops
from shardopt import state_codec
from shardopt.zero import comm, host_state
from shardopt.zero.offload_plan import CPUOffload, OffloadPlan, plan_fraction, thread_budget
from shardopt.zero.state_storage import Storage

logger = logging.getLogger("shardopt")

_MEASURE_NUMEL = 1 << 20


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


def _adam_ms(device: torch.device) -> float:
    n = _MEASURE_NUMEL
    tensors = [[torch.zeros(n, dtype=torch.float32, device=device)] for _ in range(4)]

    def update() -> None:
        _ops.adam(
            tensors, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1, adam_w_mode=True,
            bias_correction=True, weight_decay=0.0,
        )  # fmt: skip

    return _time_ms(update, device) / n


def measure(device: torch.device, grad_bytes: int, param_bytes: int) -> dict[str, float]:
    """Per-element times (ms) of the CPU update, the copies and the device update; free device
    bytes (infinite on a CPU job)."""
    cpu = _adam_ms(torch.device("cpu"))
    n = _MEASURE_NUMEL
    host = torch.empty(n * (grad_bytes + param_bytes), dtype=torch.uint8)
    dev = torch.empty_like(host, device=device)
    copy = _time_ms(lambda: (host.copy_(dev), dev.copy_(host)), device) / n
    if device.type == "cuda":
        gpu = _adam_ms(device)
        free = float(torch.cuda.mem_get_info(device)[0])
    else:
        gpu, free = cpu, math.inf
    return {"cpu_ms": cpu, "copy_ms": copy, "gpu_ms": gpu, "free_bytes": free}


def _state_bytes_per_param(optimizer, params: list[torch.Tensor], storage: Storage) -> float:
    """GPU bytes per shard element that offloading frees: the master copy (low-precision
    params) and every state tensor in its format."""
    master = 4.0 if any(p.dtype != torch.float32 for p in params) else 0.0
    return master + len(optimizer.state_names) * state_codec.bytes_per_element(storage.state_format)


def agreed_fraction(
    optimizer,
    settings: CPUOffload | None,
    storage: Storage | None,
    process_group: comm.ProcessGroup | None,
) -> float | None:
    """The fraction of every key to offload (the same on every rank), None without offload;
    sets the update's thread budget."""
    if settings is None:
        return None
    optimizer._offload_threads = thread_budget(settings.threads)
    optimizer._offload_reason = f"fraction={settings.fraction} as requested"
    optimizer._offload_measurements = {}
    if settings.fraction != "auto":
        return float(settings.fraction)
    decision: tuple | str | None = None
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if comm.rank(process_group) == 0 and params:
        try:  # a failure here must fail every rank, not leave them waiting below
            device = _ops.common_device(params, "params")
            grad = 4 if any(p.dtype != torch.float32 for p in params) else params[0].itemsize
            with host_state.threads(optimizer._offload_threads):
                found = measure(device, grad, max(p.element_size() for p in params))
            numel = -(-sum(p.numel() for p in params) // comm.world_size(process_group))
            fraction, reason = plan_fraction(
                numel=numel,
                device_bytes_per_param=_state_bytes_per_param(optimizer, params, storage),
                free_device_bytes=found["free_bytes"],
                cpu_ms_per_param=found["cpu_ms"],
                copy_ms_per_param=found["copy_ms"],
                gpu_ms_per_param=found["gpu_ms"],
                backward_ms=0.0,
            )
            decision = (fraction, "auto: " + reason, found)
        except RuntimeError as e:
            decision = f"{type(optimizer).__name__}: offload fraction='auto' could not measure: {e}"
    elif comm.rank(process_group) == 0:
        decision = (1.0, "auto: no trainable params", {})
    decision = comm.all_gather_object(decision, process_group)[0]
    if isinstance(decision, str):
        raise RuntimeError(decision)
    fraction, reason, found = decision
    optimizer._offload_reason, optimizer._offload_measurements = reason, found
    return fraction


def first_touch(optimizer, settings: CPUOffload | None) -> contextlib.AbstractContextManager:
    """The context the host state is allocated in: the update's thread budget, so the zero fill
    (parallel over the same intra-op pool as the update kernels) first-touches each page from a
    thread of that pool (NUMA-local to it on a multi-node host, as far as the OS places it)."""
    if settings is None:
        return contextlib.nullcontext()
    return host_state.threads(optimizer._offload_threads)


def record(optimizer, settings: CPUOffload | None, fraction: float | None) -> OffloadPlan | None:
    """The plan of a built optimizer (its keys exist), logged once."""
    if settings is None:
        return None
    host = [k for k in optimizer.keys if k.buffers.offloaded]
    device = [k for k in optimizer.keys if not k.buffers.offloaded]

    def count(keys: list, what: str) -> int:
        if what == "params":
            return sum(len(k.layout.params) for k in keys)
        return sum(k.layout.shard_numel for k in keys)

    plan = OffloadPlan(
        fraction=float(fraction),
        requested=settings.fraction,
        reason=optimizer._offload_reason,
        threads=optimizer._offload_threads,
        host_params=count(host, "params"),
        device_params=count(device, "params"),
        host_numel=count(host, "numel"),
        device_numel=count(device, "numel"),
        measurements=dict(optimizer._offload_measurements),
    )
    if optimizer.rank == 0:
        logger.info(
            "%s: CPU offload of %d params (%d shard elements) on %d threads, %d params on the "
            "GPU; %s",
            type(optimizer).__name__, plan.host_params, plan.host_numel, plan.threads,
            plan.device_params, plan.reason,
        )  # fmt: skip
    return plan
