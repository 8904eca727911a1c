"""bench_train.py's collective timings: reduce-scatter and all-gather at the engine's bucket
size."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    Interval,
    free_memory,
)
from bench_train_env import _all_gather, _reduce_scatter

# -- collectives ----------------------------------------------------------------------------------


def bench_collective(
    label: str, numel: int, device: torch.device, iters: int, warmup: int, pieces: int = 1
) -> dict[str, Any]:
    """Median time and bus bandwidth of reduce-scatters and all-gathers of ``numel`` fp32.

    With ``pieces`` > 1 the buffer is split into that many equal buckets, all launched
    asynchronously and then waited for, as a bucketed engine does.
    """
    world = dist.get_world_size()
    piece = math.ceil(numel / pieces / world) * world
    full = torch.randn(pieces, piece, device=device)
    shard = torch.empty(pieces, piece // world, device=device)
    nbytes = full.numel() * full.element_size()
    result: dict[str, Any] = {"label": label, "numel": full.numel(), "bytes": nbytes}

    def reduce_scatter() -> list:
        return [
            _reduce_scatter(shard[i], full[i], op=dist.ReduceOp.SUM, async_op=True)
            for i in range(pieces)
        ]

    def all_gather() -> list:
        return [_all_gather(full[i], shard[i], async_op=True) for i in range(pieces)]

    for op, launch in (("reduce_scatter", reduce_scatter), ("all_gather", all_gather)):
        for _ in range(warmup):
            for work in launch():
                work.wait()
        dist.barrier()
        timer = Interval(device)
        for _ in range(iters):
            timer.start()
            for work in launch():
                work.wait()
            timer.stop()
        ms = torch.tensor([timer.median_ms()], dtype=torch.float64)
        ms = ms.to(device) if device.type == "cuda" else ms
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        ms_value = float(ms.item())
        result[f"{op}_ms"] = ms_value
        result[f"{op}_busbw_gbs"] = (
            nbytes * (world - 1) / world / (ms_value / 1e3) / 1e9 if world > 1 else None
        )
    full = shard = None
    free_memory(device)
    return result


def engine_bucket_cap_mb() -> float:
    from shardopt.zero.engine import DistributedOptimizer

    return float(
        inspect.signature(DistributedOptimizer.__init__).parameters["bucket_cap_mb"].default
    )
