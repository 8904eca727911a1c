"""The step-time model itself (scaling_model.py): the collective fits, ring times, the overlap
queues and the predicted step of a layout."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from scaling_inputs import (
    ADAM_BYTES,
    COLLECTIVES,
    KERNEL_13B,
    MIB,
    MODELS,
    TORCH_FUSED_13B_MS,
    GPTShape,
    Layout,
    Machine,
)

# -- fits -----------------------------------------------------------------------------------------


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """a, b minimising sum(((a + b x - y) / y)^2): every row weighs by its relative error."""
    w = [1 / y**2 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def fit_collectives(machine: Machine) -> Machine:
    """alpha and the NVLink bus bandwidth from the single-call rows (RS and AG, both runs)."""
    xs, ys = [], []
    for _, mb, pieces, rs, ag in COLLECTIVES:
        if pieces == 1 and "buckets" not in _:
            for t in (rs, ag):
                xs.append(mb / 2)  # bus bytes (MB) of one call at 2 GPUs: (N-1)/N x size
                ys.append(t)
    a, b = fit_line(xs, ys)
    return dataclasses.replace(machine, alpha_us=a * 1e3, intra_busbw_gbps=1 / b)


# -- the model ------------------------------------------------------------------------------------


def ring_ms(
    size_mb: float, ranks: int, nodes: int, busbw: float, m: Machine, allreduce: bool = False
) -> float:
    """One ring collective: ``size_mb`` MB per rank over ``ranks`` ranks on ``nodes`` nodes."""
    if ranks == 1:
        return 0.0
    rounds = 2 if allreduce else 1
    steps, net_steps = rounds * (ranks - 1), rounds * (nodes - 1)
    latency_us = (m.alpha_us - m.lat_intra_us) + (steps - net_steps) * m.lat_intra_us
    latency_us += net_steps * m.lat_net_us
    bus_mb = rounds * (ranks - 1) / ranks * size_mb
    return latency_us / 1e3 + bus_mb / busbw  # MB / (GB/s) = ms


def bucket_sizes(total_mb: float, cap_mib: float) -> list[float]:
    """Buckets in key-space order: full ones, then the short one (the first layers' params)."""
    cap = cap_mib * MIB / 1e6
    n = max(1, math.ceil(total_mb / cap - 1e-9))
    return [cap] * (n - 1) + [total_mb - cap * (n - 1)]


def queue_behind(times: Sequence[float], sizes: Sequence[float], window: float) -> float:
    """Exposed time of collectives issued as their buckets fill during ``window`` ms of compute
    (bucket i ready when its share of the bytes is produced), run one after another."""
    total, done, end = sum(sizes), 0.0, 0.0
    for t, s in zip(times, sizes):
        done += s
        end = max(end, done / total * window) + t
    return max(0.0, end - window)


def queue_after(
    first: Sequence[float], second: Sequence[float], sizes: Sequence[float], window: float
) -> float:
    """End time of two chained queues: bucket i's ``second`` collective starts when its
    ``first`` one (queued as in queue_behind) and the previous ``second`` one are done."""
    total, done, end1, end2 = sum(sizes), 0.0, 0.0, 0.0
    for t1, t2, s in zip(first, second, sizes):
        done += s
        end1 = max(end1, done / total * window) + t1
        end2 = max(end2, end1) + t2
    return end2


def queue_ahead(times: Sequence[float], sizes: Sequence[float], window: float) -> float:
    """Stall of ``window`` ms of compute that needs bucket i after its share of the bytes
    before it, with every collective issued at time 0 and run one after another."""
    total, before, ready, stall = sum(sizes), 0.0, 0.0, 0.0
    for t, s in zip(times, sizes):
        ready += t
        stall = max(stall, ready - before / total * window)
        before += s
    return stall


@dataclasses.dataclass(frozen=True)
class Step:
    """One predicted step, in ms per GPU."""

    compute: float
    reduce_scatter: float  # exposed
    optimizer: float  # the update kernel (plus the blocking all-gathers without overlap)
    all_gather: float  # exposed
    contention: float
    allreduce: float  # HSDP, exposed
    comm_total: float  # every collective's own time, overlapped or not

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.reduce_scatter
            + self.optimizer
            + self.all_gather
            + self.contention
            + self.allreduce
        )


def compute_ms(shape: GPTShape, reference_ms: float) -> float:
    """Forward + backward, scaled from the 1.4B's by training FLOPs per token."""
    ref = MODELS["1.4b"]
    return (
        reference_ms
        * (shape.flops_per_token * shape.tokens_per_gpu)
        / (ref.flops_per_token * ref.tokens_per_gpu)
    )


def optimizer_ms(params: float, m: Machine, bytes_per_param: float = ADAM_BYTES) -> float:
    return params * bytes_per_param / (m.adam_share * m.copy_gbps * 1e9) * 1e3


def predict(shape: GPTShape, lay: Layout, m: Machine, compute: float) -> Step:
    """Step time of DistributedFusedAdam (fp32 params, grads and all-gathers) at ``lay``."""
    shard, g = lay.shard, lay.node_size
    shard_nodes = 1 if shard <= g else lay.nodes
    if shard_nodes == 1:
        busbw = m.intra_busbw_gbps
    else:  # a ring through every node: NVLink carries (g-1)/g of a GPU's bytes, its NIC 1/g
        nvlink = m.intra_busbw_gbps * g / (g - 1) if g > 1 else math.inf
        busbw = min(nvlink, g * m.net_busbw_gbps)
    grads_mb = shape.params * 4 / 1e6
    sizes = bucket_sizes(grads_mb, lay.bucket_mb)
    rs = [ring_ms(s, shard, shard_nodes, busbw, m) for s in sizes]
    ag = [ring_ms(s, shard, shard_nodes, busbw, m) for s in reversed(sizes)]  # forward order
    opt = optimizer_ms(shape.params / shard, m)
    comm = sum(rs) + sum(ag)
    if lay.overlap and shard > 1:
        bus_mb = 2 * sum((shard - 1) / shard * s for s in sizes)
        contention = m.kappa * bus_mb / m.intra_busbw_gbps
        rs_exposed = queue_behind(rs, sizes, m.bwd_share * compute)
        ag_exposed = queue_ahead(ag, list(reversed(sizes)), (1 - m.bwd_share) * compute)
    else:  # reduce-scatters after backward, all-gathers inside step()
        contention, rs_exposed, ag_exposed = 0.0, sum(rs), 0.0
        opt += sum(ag)
    allreduce = 0.0
    if lay.replicas > 1:  # each GPU's grad shard over its own NIC, one GPU per node
        r = lay.replicas
        if lay.overlap_allreduce:
            ar = [ring_ms(s / shard, r, r, m.net_busbw_gbps, m, allreduce=True) for s in sizes]
            contention += (
                m.kappa * sum(2 * (r - 1) / r * s / shard for s in sizes) / (m.intra_busbw_gbps)
            )
            window = m.bwd_share * compute
            allreduce = max(0.0, queue_after(rs, ar, sizes, window) - window) - rs_exposed
        else:
            ar = [ring_ms(grads_mb / shard, r, r, m.net_busbw_gbps, m, allreduce=True)]
            allreduce = ar[0]
        comm += sum(ar)
    return Step(compute, rs_exposed, opt, ag_exposed, contention, allreduce, comm)


def predict_ddp(shape: GPTShape, gpus: int, m: Machine, compute: float, bucket_mb: float) -> Step:
    """DDP + torch fused AdamW at 2 GPUs of one node (a cross-check of alpha-beta and kappa):
    all-reduces of ``bucket_mb`` overlapped with backward, the full update at torch's speed."""
    grads_mb = shape.params * 4 / 1e6
    sizes = bucket_sizes(grads_mb, bucket_mb)
    ar = [ring_ms(s, gpus, 1, m.intra_busbw_gbps, m, allreduce=True) for s in sizes]
    bus_mb = sum(2 * (gpus - 1) / gpus * s for s in sizes)
    contention = m.kappa * bus_mb / m.intra_busbw_gbps
    exposed = queue_behind(ar, sizes, m.bwd_share * compute)
    torch_ratio = TORCH_FUSED_13B_MS / KERNEL_13B[0]
    opt = optimizer_ms(shape.params, m) * torch_ratio
    return Step(compute, exposed, opt, 0.0, contention, 0.0, sum(ar))
