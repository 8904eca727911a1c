"""One contender of bench_offload.py measured in one process (a fresh one per contender, so that
GPU peak, host RSS and a peer's global state start clean and an OOM kill ends only the attempt).

``measure(spec)`` builds the contender, trains warm-up then timed steps per clip setting and
returns a record; ``main()`` is the subprocess entry (``python bench_offload_worker.py JSON``): it
prints the record as one ``BENCH_RESULT <json>`` line on stdout.

Times are medians of CUDA-event intervals around whole steps (forward, backward, clip, step,
zero_grad) after the warm-up; ``time.perf_counter`` on the CPU. GPU peak is
``torch.cuda.max_memory_allocated`` since the process started (pinned host memory is not in it),
and per phase the last timed step's own peak (``gpu_peak_last_step_gib``: the steady state, after
``fraction="auto"`` re-planned);
host RSS is VmHWM of /proc/self/status, whose peak is reset after the imports and the process
group, so ``host_bytes_per_param`` counts what the contender added.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import Interval, import_shardopt  # noqa: E402
from bench_offload_peers import (  # noqa: E402
    GIB,
    LR,
    WEIGHT_DECAY,
    Skipped,
    backend_for,
    build,
    count_params,
    huge_pages,
    model_config,
    offload_record,
    preimport,
)

RESULT_PREFIX = "BENCH_RESULT "


@dataclasses.dataclass
class Spec:
    """What one worker measures (passed to the subprocess as JSON)."""

    contender: str
    device: str
    width: int
    depth: int
    vocab: int = 50304
    seq: int = 2048
    batch: int = 4
    warmup: int = 3
    steps: int = 5
    clips: tuple[bool, ...] = (False,)
    max_norm: float = 1.0
    threads: int | None = None
    checkpointing: bool = False
    cpu_chunk: int = 1 << 26


# -- host memory ----------------------------------------------------------------------------------


def host_rss_bytes() -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak since the last reset) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Restarts VmHWM at the current RSS (Linux: "5" into clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- process group --------------------------------------------------------------------------------


def init_process_group(backend: str) -> None:
    """A one-process group through the environment (as torchrun sets it, so DeepSpeed finds
    rank and world without mpi)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    dist.init_process_group(backend, rank=0, world_size=1)


# -- the CPU update alone -------------------------------------------------------------------------


def cpu_update(n_params: int, spec: Spec) -> dict[str, Any]:
    """shardopt's CPU Adam over ``n_params`` host elements in chunks of ``spec.cpu_chunk``: fp32
    masters and moments, bf16 grads in, bf16 params out (the cast fused into the update), in host
    memory allocated as the offload path does (CPUOffload's default pages, or as
    BENCH_OFFLOAD_HUGE_PAGES says)."""
    import shardopt
    from shardopt import kernels as _ops
    from shardopt.zero.offload import host_memory

    huge = huge_pages()
    if huge is None:
        huge = shardopt.CPUOffload().huge_pages

    def host(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return host_memory.empty(n, dtype, huge)

    sizes = [min(spec.cpu_chunk, n_params - i) for i in range(0, n_params, spec.cpu_chunk)]
    grads = [host(n, torch.bfloat16).uniform_(-1e-3, 1e-3) for n in sizes]
    masters = [host(n).uniform_(-0.05, 0.05) for n in sizes]
    exp_avg = [host(n).zero_() for n in sizes]
    exp_avg_sq = [host(n).zero_() for n in sizes]
    outs = [host(n, torch.bfloat16) for n in sizes]
    times = []
    for it in range(spec.warmup + spec.steps):
        start = time.perf_counter()
        _ops.adam(
            [grads, masters, exp_avg, exp_avg_sq, outs],
            lr=LR,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            step=it + 1,
            adam_w_mode=True,
            bias_correction=True,
            weight_decay=WEIGHT_DECAY,
        )
        if it >= spec.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {
        "phases": [{"clip": False, "step_ms": statistics.median(times), "times_ms": times}],
        "settings": {
            "kernel": "shardopt.kernels.adam (CPU)",
            "chunks": len(sizes),
            "huge_pages": huge,
        },
    }


# -- a trainer ------------------------------------------------------------------------------------


def run_trainer(spec: Spec, device: torch.device) -> dict[str, Any]:
    cfg = model_config(spec.width, spec.depth, spec.vocab, spec.seq)
    trainer = build(spec.contender, cfg, device, spec.batch, spec.checkpointing, spec.clips)
    generator = torch.Generator(device=device).manual_seed(1234)
    idx, targets = (
        torch.randint(spec.vocab, (spec.batch, spec.seq), device=device, generator=generator)
        for _ in range(2)
    )
    phases = []
    peak = [0]  # the process's GPU peak before each per-step reset
    try:
        for clip in spec.clips:
            if clip and trainer.clip is None:
                phases.append({"clip": True, "skipped": trainer.clip_unsupported})
                continue
            timer, losses, step_peaks = Interval(device), [], []
            for it in range(spec.warmup + spec.steps):
                timed = it >= spec.warmup
                if timed and device.type == "cuda":  # each timed step's own GPU peak
                    peak[0] = max(peak[0], torch.cuda.max_memory_allocated(device))
                    torch.cuda.reset_peak_memory_stats(device)
                if timed:
                    timer.start()
                with torch.autocast(device.type, torch.bfloat16, enabled=trainer.autocast):
                    loss = trainer.forward(idx, targets)
                trainer.backward(loss)
                if clip:
                    trainer.clip(spec.max_norm)
                trainer.step()
                if timed:
                    timer.stop()
                    if device.type == "cuda":
                        step_peaks.append(torch.cuda.max_memory_allocated(device) / GIB)
                losses.append(loss.detach())
            times = timer.times_ms()
            phases.append(
                {
                    "clip": clip,
                    "step_ms": statistics.median(times),
                    "times_ms": times,
                    "losses": [float(x) for x in losses],
                    # the last timed step's GPU peak: the steady state (after an auto re-plan)
                    **({"gpu_peak_last_step_gib": step_peaks[-1]} if step_peaks else {}),
                }
            )
        record = {"phases": phases, "settings": trainer.settings}
        if device.type == "cuda":
            record["gpu_peak_bytes"] = max(peak[0], torch.cuda.max_memory_allocated(device))
        record.update(offload_record(trainer.optimizer))
        return record
    finally:
        if trainer.close is not None:
            trainer.close()


def measure(spec: Spec) -> dict[str, Any]:
    """Builds and measures ``spec.contender``; a record with ``skipped`` or ``error`` on failure."""
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # (torch.cuda.set_device needs an index)
    cfg = model_config(spec.width, spec.depth, spec.vocab, spec.seq)
    n_params = count_params(cfg)
    base: dict[str, Any] = {
        "contender": spec.contender,
        "width": spec.width,
        "depth": spec.depth,
        "params": n_params,
        "tokens_per_step": spec.batch * spec.seq,
    }
    if spec.threads:
        torch.set_num_threads(spec.threads)
    base["threads"] = torch.get_num_threads()
    try:
        import_shardopt()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group(backend_for(spec.contender, device))
        preimport(spec.contender)
        # the CUDA context and the communicator exist before the host memory baseline
        dist.all_reduce(torch.zeros(1, device=device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rss_start = host_rss_bytes()["VmRSS"]
        base["peak_rss_reset"] = reset_peak_rss()
        if spec.contender == "cpu_update":
            record = cpu_update(n_params, spec)
        else:
            record = run_trainer(spec, device)
    except Skipped as e:
        return {**base, "skipped": str(e)}
    except Exception as e:  # reported in the table; the traceback goes to the worker's log
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        out = {**base, "error": f"{type(e).__name__}: {first}"}
        if isinstance(e, torch.cuda.OutOfMemoryError):
            out["oom"] = "gpu"
        return out
    finally:
        if dist.is_initialized():  # (in-process runs: the next contender makes its own)
            dist.destroy_process_group()
    rss = host_rss_bytes()
    record.update(base)
    record["host_rss_gib"] = rss["VmRSS"] / GIB
    record["host_peak_rss_gib"] = rss["VmHWM"] / GIB
    record["host_bytes_per_param"] = (rss["VmHWM"] - rss_start) / n_params
    if device.type == "cuda":
        process_peak = max(record.pop("gpu_peak_bytes", 0), torch.cuda.max_memory_allocated(device))
        record["gpu_peak_gib"] = process_peak / GIB
    for phase in record["phases"]:
        if "step_ms" in phase:
            phase["tokens_per_s"] = spec.batch * spec.seq / (phase["step_ms"] / 1e3)
    return record


def blocking_sync() -> bool:
    """BENCH_OFFLOAD_BLOCKING_SYNC=1: the GPU's primary context is made with
    CU_CTX_SCHED_BLOCKING_SYNC, before torch makes it, so host threads waiting on the GPU sleep
    instead of spinning on a core the CPU update could use (CUDA's default on a host with more
    cores than contexts is to spin). Whether the flag was set."""
    if os.environ.get("BENCH_OFFLOAD_BLOCKING_SYNC") != "1":
        return False
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    set_flags = (
        getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    )
    for name, rc in (
        ("cuInit", lambda: cuda.cuInit(0)),
        ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDevicePrimaryCtxSetFlags", lambda: set_flags(dev, 0x04)),  # BLOCKING_SYNC
    ):
        code = rc()
        if code != 0:
            raise RuntimeError(f"BENCH_OFFLOAD_BLOCKING_SYNC: {name} failed with CUresult {code}")
    return True


def main() -> None:
    # a host OOM picks this process first, not the benchmark driver or the machine's agent
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    fields = json.loads(sys.argv[1])
    fields["clips"] = tuple(fields.get("clips", (False,)))
    blocking = blocking_sync()
    record = measure(Spec(**fields))
    record["blocking_sync"] = blocking
    print(RESULT_PREFIX + json.dumps(record, default=str), flush=True)


if __name__ == "__main__":
    main()
