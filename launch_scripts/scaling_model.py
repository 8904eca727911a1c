"""Step-time model of DistributedFusedAdam training, from 1 to 1,024 GPUs (docs/scaling.md).

The step time per GPU of weak-scaled data-parallel training (a fixed batch per GPU) as a function
of model size, world size, GPUs per node, bucket size and link bandwidths, assembled from parts
measured on 2 x H200 (docs/benchmarks.md, commit 7d95db8) and a few stated assumptions:

    step = compute + exposed reduce-scatter + optimizer kernel + exposed all-gather
           + contention (overlapped collectives slowing the compute) + HSDP all-reduce

- compute: forward + backward at 8 x 1024 tokens per GPU; for the 1.4B GPT it is derived from the
  no-overlap row (step minus its exposed reduce-scatters minus its optimizer step), for other
  models scaled by training FLOPs per token (same achieved FLOP rate);
- optimizer kernel: bytes per param / (share of copy bandwidth x copy bandwidth), on this GPU's
  shard (docs/benchmarks.md kernel rows);
- collectives: ring alpha-beta, ``t = alpha + steps x latency + bus bytes / bus bandwidth``;
  alpha and the NVLink bus bandwidth fitted on the single-call rows of the 2-GPU collective
  table, per-step latencies and the network (bandwidth, efficiency) assumed; a ring across nodes
  is bounded by
  NVLink ((G-1)/G of each GPU's bytes) and by the G NICs of a node (1/G of its bytes each);
- overlap: reduce-scatters queue behind backward (buckets ready in proportion to their bytes over
  2/3 of the compute), all-gathers ahead of forward (the last 1/3); what does not fit is exposed;
- contention: overlapped collectives cost kappa x (their bus bytes / NVLink bus bandwidth) of
  compute; kappa is fitted on the overlap row (100 MB buckets, first run);
- HSDP (shard within a node of G GPUs, replicate across the N/G nodes): reduce-scatter and
  all-gather stay in the node, and after backward each GPU all-reduces its 1/G grad shard over its
  own NIC with the same GPU of every other node: a ring of N/G, exposed (the engine runs it after
  the last reduce-scatter, before the update).

    python launch_scripts/scaling_model.py                  # checks, tables, recommendation
    python launch_scripts/scaling_model.py --write-docs     # also docs/scaling.md + the plot
    python launch_scripts/scaling_model.py --model 7b --gpus 256 --hsdp --bucket-mb 1600
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "scaling.md"
PLOT = REPO / "docs" / "img" / "scaling_model.png"
BEGIN, END = "<!-- scaling_model.py: begin -->", "<!-- scaling_model.py: end -->"
MIB = 2**20
SRC = "docs/benchmarks.md"

# -- measured (docs/benchmarks.md, 2 x H200 NVLink, torch 2.11.0+cu130, commit 7d95db8) -----------

COPY_GBPS = 4274.0  # "Device copy bandwidth measured in the same run: 4,274 GB/s"
ADAM_SHARE_FLAT = 0.956  # kernel table: flat, fp32, adam, shardopt: 95.6% of copy
ADAM_BYTES = 28  # B/param of an fp32 Adam update (read g, p, m, v; write p, m, v)
KERNEL_13B = (9.006, 4091.0)  # kernel table: 1.3b, fp32, adam, shardopt: ms, GB/s
TORCH_FUSED_13B_MS = 10.598  # kernel table: 1.3b, fp32, adam, torch_fused

# Collective table: (label, MB of the buffer, buckets it is split into, RS ms, AG ms); run 1 is
# the first table under "Training step on 2 x H200", run 2 the second.
COLLECTIVES = [
    ("run 1: full grads, one call", 5665.2, 1, 9.953, 9.938),
    ("run 1: one bucket (100 MB cap)", 104.9, 1, 0.246, 0.238),
    ("run 1: one bucket (400 MB cap)", 419.4, 1, 0.852, 0.835),
    ("run 1: one bucket (1600 MB cap)", 1677.7, 1, 2.952, 3.002),
    ("run 2: full grads, one call", 5665.2, 1, 9.679, 9.754),
    ("run 2: one bucket (400 MB cap)", 419.4, 1, 0.856, 0.837),
    ("run 2: one bucket (1600 MB cap)", 1677.7, 1, 2.947, 2.990),
    ("run 2: one bucket (6400 MB cap)", 5665.2, 1, 9.918, 9.748),
    ("run 1: full grads, 55 buckets of 100 MB", 5665.2, 55, 14.710, 22.236),
    ("run 1: full grads, 14 buckets of 400 MB", 5665.2, 14, 11.792, 11.535),
    ("run 1: full grads, 4 buckets of 1600 MB", 5665.2, 4, 10.133, 10.250),
    ("run 2: full grads, 14 buckets of 400 MB", 5665.2, 14, 11.811, 11.522),
    ("run 2: full grads, 4 buckets of 1600 MB", 5665.2, 4, 10.221, 10.435),
    ("run 2: full grads, 1 buckets of 6400 MB", 5665.2, 1, 9.729, 9.721),
]


@dataclasses.dataclass(frozen=True)
class StepRow:
    """A measured 2-GPU training-step row of docs/benchmarks.md."""

    source: str
    mode: str  # shardopt_adam (no overlap), shardopt_adam_overlap, ddp_adamw
    bucket_mb: float
    step_ms: float
    opt_ms: float | None
    role: str = "check"  # "fit: compute", "fit: kappa" or "check"


STEP_ROWS = [
    StepRow("run 1", "shardopt_adam", 100, 168.2, 17.69, role="fit: compute"),
    StepRow("CUDA-graph run", "shardopt_adam", 100, 166.5, 17.69),
    StepRow("run 1", "shardopt_adam_overlap", 100, 157.5, 5.01, role="fit: kappa"),
    StepRow("CUDA-graph run", "shardopt_adam_overlap", 100, 156.0, 4.99),
    StepRow("run 1", "shardopt_adam_overlap_big", 400, 156.1, 5.04),
    StepRow("run 2", "shardopt_adam_overlap", 400, 155.9, 5.02),
    StepRow("run 2", "shardopt_adam_overlap_big", 1600, 156.3, 5.04),
    StepRow("run 1", "ddp_adamw", 25, 166.8, 11.94),
    StepRow("run 2", "ddp_adamw", 25, 165.4, 11.93),
    StepRow("CUDA-graph run", "ddp_adamw", 25, 166.0, 11.93),
]

# -- the models -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """bench_train.py's GPT: untied embeddings, 12 d^2 per block, fp32 params, bf16 autocast."""

    name: str
    d_model: int
    layers: int
    vocab: int = 50304
    seq: int = 1024
    batch: int = 8  # sequences per GPU (bench_train.py default)

    @property
    def params(self) -> int:
        d = self.d_model
        block = 12 * d * d + 4 * d  # qkv, proj, fc, fc2; two LayerNorms
        return self.layers * block + 2 * self.vocab * d + self.seq * d + 2 * d

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x matmul params (blocks and lm_head) + attention."""
        matmul = self.layers * 12 * self.d_model**2 + self.vocab * self.d_model
        return 6 * matmul + 12 * self.layers * self.seq * self.d_model

    @property
    def tokens_per_gpu(self) -> int:
        return self.batch * self.seq


MODELS = {
    "1.4b": GPTShape("1.4B", d_model=2048, layers=24),  # docs/benchmarks.md's model
    "7b": GPTShape("7B", d_model=4096, layers=32),  # GPT-3 6.7B / LLaMA-7B shape
}

# -- the machine ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    """Link and kernel parameters (GB/s are 1e9 bytes/s, latencies in microseconds)."""

    copy_gbps: float = COPY_GBPS
    adam_share: float = ADAM_SHARE_FLAT
    alpha_us: float = 60.0  # per-call overhead at 2 GPUs (fitted; replaced by fit_collectives)
    intra_busbw_gbps: float = 286.0  # NVLink ring bus bandwidth (fitted likewise)
    lat_intra_us: float = 3.0  # per ring step inside a node (assumed)
    lat_net_us: float = 10.0  # per ring step across nodes (assumed)
    net_gbps: float = 400.0  # NIC line rate per GPU, Gb/s (assumed: one 400 Gb/s NIC per GPU)
    net_eff: float = 0.9  # share of the line rate a large collective reaches (assumed)
    kappa: float = 0.0  # compute slowdown per overlapped collective time (fitted)
    bwd_share: float = 2 / 3  # share of compute that is backward (assumed: 2x the forward)

    @property
    def net_busbw_gbps(self) -> float:
        return self.net_gbps / 8 * self.net_eff


@dataclasses.dataclass(frozen=True)
class Layout:
    gpus: int
    gpus_per_node: int = 8
    hsdp: bool = False
    bucket_mb: float = 100.0  # MiB, as bucket_cap_mb
    overlap: bool = True
    # what-if, not what the engine does: each bucket's HSDP all-reduce issued after its
    # reduce-scatter during backward, instead of one all-reduce of the grad shard after it
    overlap_allreduce: bool = False

    @property
    def node_size(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def shard(self) -> int:
        """Ranks in the optimizer's process group."""
        return self.node_size if self.hsdp else self.gpus

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard


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


# -- calibration and checks -----------------------------------------------------------------------


@dataclasses.dataclass
class Calibration:
    machine: Machine
    compute_ms: float  # the 1.4B's forward + backward at 8 x 1024 tokens per GPU
    given: bool = False  # compute_ms from --compute-ms, not derived


def calibrate(base: Machine, compute_override: float | None = None) -> Calibration:
    """alpha, NVLink bandwidth, then compute from the no-overlap row, then kappa from the
    overlap row (both 100 MB buckets, run 1): each row reproduced exactly by construction."""
    m = fit_collectives(base)
    shape = MODELS["1.4b"]
    nofit = next(r for r in STEP_ROWS if r.role == "fit: compute")
    if compute_override is None:
        lay = Layout(2, bucket_mb=nofit.bucket_mb, overlap=False)
        without = predict(shape, lay, m, compute=0.0).total
        compute = nofit.step_ms - without
    else:
        compute = compute_override
    krow = next(r for r in STEP_ROWS if r.role == "fit: kappa")
    lay = Layout(2, bucket_mb=krow.bucket_mb)
    m0 = dataclasses.replace(m, kappa=0.0)
    m1 = dataclasses.replace(m, kappa=1.0)
    t0, t1 = predict(shape, lay, m0, compute).total, predict(shape, lay, m1, compute).total
    kappa = (krow.step_ms - t0) / (t1 - t0)
    return Calibration(dataclasses.replace(m, kappa=kappa), compute, compute_override is not None)


def pct(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%"


def check_rows(cal: Calibration) -> list[list[str]]:
    """Every measured row against the model: [what, source, measured, predicted, error, role]."""
    m, shape, rows = cal.machine, MODELS["1.4b"], []
    for r in STEP_ROWS:
        if r.mode == "ddp_adamw":
            step = predict_ddp(shape, 2, m, cal.compute_ms, r.bucket_mb)
        else:
            lay = Layout(2, bucket_mb=r.bucket_mb, overlap=r.mode != "shardopt_adam")
            step = predict(shape, lay, m, cal.compute_ms)
        src = f"{SRC}, 2 x H200, {r.source}"
        what = f"{r.mode}, {r.bucket_mb:g} MB: step ms"
        err = pct(step.total, r.step_ms)
        rows.append([what, src, f"{r.step_ms:.1f}", f"{step.total:.1f}", err, r.role])
        if r.opt_ms is not None and r.mode != "ddp_adamw":
            what = f"{r.mode}, {r.bucket_mb:g} MB: optimizer step ms"
            err = pct(step.optimizer, r.opt_ms)
            rows.append([what, src, f"{r.opt_ms:.2f}", f"{step.optimizer:.2f}", err, "check"])
    rows.append(_ddp_opt_row(m))
    rows.append(_kernel_row(m))
    for label, mb, pieces, rs, ag in COLLECTIVES:
        sizes = bucket_sizes(mb, 1e9) if pieces == 1 else [mb / pieces] * pieces
        pred = sum(ring_ms(s, 2, 1, m.intra_busbw_gbps, m) for s in sizes)
        role = "fit: alpha, bandwidth" if pieces == 1 and "buckets" not in label else "check"
        for op, meas in (("reduce-scatter", rs), ("all-gather", ag)):
            rows.append([f"{label}: {op} ms", f"{SRC}, 2 x H200 collectives", f"{meas:.3f}",
                         f"{pred:.3f}", pct(pred, meas), role])  # fmt: skip
    return rows


def _kernel_row(m: Machine) -> list[str]:
    ms, gbps = KERNEL_13B
    params = ms * 1e-3 * gbps * 1e9 / ADAM_BYTES  # the 1.3b set's size, from its row
    pred = optimizer_ms(params, m)
    return ["1 GPU: FusedAdam step, 1.3b set, fp32", f"{SRC}, kernel table, one H200",
            f"{ms:.3f}", f"{pred:.3f}", pct(pred, ms), "check"]  # fmt: skip


def _ddp_opt_row(m: Machine) -> list[str]:
    pred = optimizer_ms(MODELS["1.4b"].params, m) * TORCH_FUSED_13B_MS / KERNEL_13B[0]
    meas = STEP_ROWS[-3].opt_ms
    what = "ddp_adamw: optimizer step ms (torch fused AdamW, all params)"
    return [what, f"{SRC}, 2 x H200, run 1", f"{meas:.2f}", f"{pred:.2f}", pct(pred, meas), "check"]


# -- tables, recommendation, plot -----------------------------------------------------------------

GPU_COUNTS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
BUCKETS = [100, 400, 1600]


def efficiency(shape: GPTShape, lay: Layout, cal: Calibration) -> tuple[float, Step]:
    """Weak-scaling efficiency: the 1-GPU step (compute + the whole update, no collectives)
    over the step at ``lay``."""
    compute = compute_ms(shape, cal.compute_ms)
    one = compute + optimizer_ms(shape.params, cal.machine)
    step = predict(shape, lay, cal.machine, compute)
    return one / step.total, step


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def scaling_table(shape: GPTShape, cal: Calibration, gpn: int) -> str:
    header = ["GPUs"] + [
        f"{'HSDP' if h else 'ZeRO'} {b} MB" for h in (False, True) for b in BUCKETS
    ]
    rows = []
    for n in GPU_COUNTS:
        row = [f"{n:,}"]
        for hsdp in (False, True):
            for b in BUCKETS:
                eff, step = efficiency(shape, Layout(n, gpn, hsdp, b), cal)
                row.append(f"{eff:.0%} ({step.total:.0f})")
        rows.append(row)
    return md_table(header, rows)


def best(shape: GPTShape, n: int, cal: Calibration, gpn: int, hsdp: bool) -> tuple[int, float]:
    effs = [(efficiency(shape, Layout(n, gpn, hsdp, b), cal)[0], b) for b in BUCKETS]
    eff, bucket = max(effs)
    return bucket, eff


def breakdown_table(cal: Calibration, gpn: int) -> str:
    header = ["model", "GPUs", "layout", "bucket MB", "compute", "RS exposed", "optimizer",
              "AG exposed", "contention", "HSDP all-reduce", "step ms", "efficiency"]  # fmt: skip
    rows = []
    for key in MODELS:
        shape = MODELS[key]
        for n in (8, 64, 1024):
            for hsdp, what_if in ((False, False), (True, False), (True, True)):
                if hsdp and n <= gpn:
                    continue
                for b in (100, 1600):
                    lay = Layout(n, gpn, hsdp, b, overlap_allreduce=what_if)
                    eff, s = efficiency(shape, lay, cal)
                    parts = (s.compute, s.reduce_scatter, s.optimizer, s.all_gather, s.contention,
                             s.allreduce)  # fmt: skip
                    name = "HSDP, all-reduce overlapped (what-if)" if what_if else _label(lay)[:4]
                    cells = [f"{x:.1f}" for x in parts] + [f"{s.total:.1f}", f"{eff:.0%}"]
                    rows.append([shape.name, f"{n:,}", name, str(b), *cells])
    return md_table(header, rows)


def _label(lay: Layout) -> str:
    return f"{'HSDP' if lay.hsdp else 'ZeRO'} {lay.bucket_mb:g} MB"


def recommendation(cal: Calibration, gpn: int) -> str:
    lines = []
    for shape in MODELS.values():
        per_n = []
        for n in GPU_COUNTS:
            modes = (False, True) if n > gpn else (False,)
            cands = [Layout(n, gpn, h, b) for h in modes for b in BUCKETS]
            lay = max(cands, key=lambda c: efficiency(shape, c, cal)[0])
            per_n.append(f"{n:,}: {_label(lay)} ({efficiency(shape, lay, cal)[0]:.0%})")
        switch = next(
            (
                n
                for n in GPU_COUNTS
                if n > gpn
                and efficiency(shape, Layout(n, gpn, True, 100), cal)[0]
                > efficiency(shape, Layout(n, gpn, False, 100), cal)[0]
            ),
            None,
        )
        top = GPU_COUNTS[-1]
        bz, ez = best(shape, top, cal, gpn, hsdp=False)
        bh, eh = best(shape, top, cal, gpn, hsdp=True)
        hsdp_step = efficiency(shape, Layout(top, gpn, True, bh), cal)[1]
        whatif = max(
            (efficiency(shape, Layout(top, gpn, True, b, overlap_allreduce=True), cal)[0], b)
            for b in BUCKETS
        )
        text = f"- **{shape.name}** ({shape.params / 1e9:.2f}B params). Best layout and bucket "
        text += "size per GPU count: " + "; ".join(per_n) + ". "
        if switch is None:
            text += f"With the default 100 MB buckets flat ZeRO stays ahead of HSDP to {top:,}. "
        else:
            text += (
                f"With the default 100 MB buckets flat ZeRO falls behind HSDP from **{switch:,} "
                f"GPUs**; with {bz} MB buckets it stays ahead to {top:,} ({ez:.0%} vs HSDP's "
                f"best {eh:.0%}). "
            )
        text += (
            f"HSDP's cost at {top:,} GPUs is its all-reduce, exposed after backward "
            f"({hsdp_step.allreduce:.1f} ms); issued per bucket during backward (an engine change, "
            f"not implemented) HSDP would reach {whatif[0]:.0%} ({whatif[1]} MB)."
        )
        lines.append(text)
    return "\n".join(lines)


def sensitivity_table(cal: Calibration, gpn: int) -> str:
    """Efficiency at 1,024 GPUs when one assumed network parameter moves off its default."""
    m = cal.machine
    cases = [("defaults", {})]
    cases += [(f"NIC {g} Gb/s", {"net_gbps": g}) for g in (100, 200, 800)]
    cases += [(f"net step latency {v} us", {"lat_net_us": v}) for v in (5, 20)]
    cases += [(f"in-node step latency {v} us", {"lat_intra_us": v}) for v in (1, 6)]
    header = ["model", "change", "ZeRO 100 MB", "best ZeRO", "HSDP 100 MB", "best HSDP"]
    rows = []
    for shape in MODELS.values():
        for name, change in cases:
            c = Calibration(dataclasses.replace(m, **change), cal.compute_ms)
            z100 = efficiency(shape, Layout(1024, gpn, False, 100), c)[0]
            h100 = efficiency(shape, Layout(1024, gpn, True, 100), c)[0]
            bz, ez = best(shape, 1024, c, gpn, hsdp=False)
            bh, eh = best(shape, 1024, c, gpn, hsdp=True)
            rows.append([shape.name, name, f"{z100:.0%}", f"{ez:.0%} ({bz} MB)", f"{h100:.0%}",
                         f"{eh:.0%} ({bh} MB)"])  # fmt: skip
    return md_table(header, rows)


def inputs_table(cal: Calibration, base: Machine) -> str:
    m = cal.machine
    one = MODELS["1.4b"]
    rows = [
        ["1.4B compute (forward + backward, 8 x 1024 tokens/GPU)", f"{cal.compute_ms:.1f} ms",
         "given: `--compute-ms`" if cal.given else
         "derived: run 1 `shardopt_adam` step 168.2 ms minus its predicted 55 exposed "
         "reduce-scatters and optimizer step (kernel + 55 all-gathers); reproduces that row"],
        ["7B compute", f"{compute_ms(MODELS['7b'], cal.compute_ms):.1f} ms",
         f"assumed: 1.4B compute x training FLOPs/token ratio "
         f"{MODELS['7b'].flops_per_token / one.flops_per_token:.2f} (same achieved FLOP rate)"],
        ["copy bandwidth", f"{m.copy_gbps:,.0f} GB/s", f"measured: {SRC}, kernel table header"],
        ["FusedAdam share of copy", f"{m.adam_share:.1%}", f"measured: {SRC}, flat fp32 adam row"],
        ["Adam bytes per param", f"{ADAM_BYTES}", f"{SRC}, B/param column (fp32)"],
        ["per-call overhead alpha", f"{m.alpha_us:.0f} us",
         "fitted: single-call RS and AG rows (both runs), relative least squares"],
        ["NVLink ring bus bandwidth", f"{m.intra_busbw_gbps:.0f} GB/s",
         "fitted: same rows; assumed the same for 8 GPUs on NVSwitch"],
        ["latency per ring step in a node", f"{m.lat_intra_us:g} us", "assumed"],
        ["latency per ring step across nodes", f"{m.lat_net_us:g} us", "assumed (see sensitivity)"],
        ["NIC per GPU", f"{m.net_gbps:g} Gb/s x {m.net_eff:.0%} = {m.net_busbw_gbps:.0f} GB/s",
         "assumed: one 400 Gb/s InfiniBand NIC per GPU (flag `--net-gbps`, `--net-eff`)"],
        ["backward share of compute", f"{m.bwd_share:.2f}", "assumed (backward = 2 x forward)"],
        ["contention kappa", f"{m.kappa:.2f}",
         "fitted: run 1 `shardopt_adam_overlap` 157.5 ms (100 MB); reproduces that row"],
        ["1.4B params", f"{one.params:,}", "bench_train.py's model (5,665.2 MB of fp32 grads)"],
        ["7B params", f"{MODELS['7b'].params:,}", "d 4096, 32 layers, same vocab and sequence"],
    ]  # fmt: skip
    del base
    return md_table(["input", "value", "source"], rows)


def render(cal: Calibration, base: Machine, gpn: int, argv: str) -> str:
    checks = check_rows(cal)
    step_checks = [
        r for r in checks if r[5] == "check" and r[0].endswith(": step ms") and "ddp" not in r[0]
    ]
    worst = max(abs(float(r[4].rstrip("%"))) for r in step_checks)
    parts = [
        f"Generated by `python launch_scripts/scaling_model.py{argv}`; do not edit by hand.",
        "### Inputs",
        inputs_table(cal, base),
        "### Checks against the measurements",
        f"Worst error on a shardopt step-time row the model was not fitted on: **{worst:.1f}%**.",
        md_table(["what", "source", "measured", "predicted", "error", "role"], checks),
        f"### Predicted weak-scaling efficiency ({gpn} GPUs per node)",
        "Efficiency = the model's 1-GPU step (compute + the whole Adam update, no collectives) "
        "over the step at N GPUs, the per-GPU batch fixed (8 x 1024 tokens); in brackets the step "
        "in ms. ZeRO: one process group over all GPUs. HSDP: shard within a node, replicate "
        "across nodes (`hsdp_groups()`); at 8 GPUs or fewer both are the same one-node layout.",
        f"**{MODELS['1.4b'].name}**",
        scaling_table(MODELS["1.4b"], cal, gpn),
        f"**{MODELS['7b'].name}**",
        scaling_table(MODELS["7b"], cal, gpn),
        "### Where the time goes (ms per step)",
        breakdown_table(cal, gpn),
        "### What it implies",
        recommendation(cal, gpn),
        "### Sensitivity at 1,024 GPUs to the assumed network parameters",
        "One parameter changed at a time; best = the best of 100, 400 and 1600 MB buckets.",
        sensitivity_table(cal, gpn),
    ]
    return "\n\n".join(parts) + "\n"


def plot(cal: Calibration, gpn: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for ax, key in zip(axes, MODELS):
        shape = MODELS[key]
        for hsdp, style in ((False, "-"), (True, "--")):
            for b, color in zip(BUCKETS, ("tab:red", "tab:orange", "tab:blue")):
                effs = [efficiency(shape, Layout(n, gpn, hsdp, b), cal)[0] for n in GPU_COUNTS]
                label = f"{'HSDP' if hsdp else 'ZeRO'}, {b} MB buckets"
                ax.plot(GPU_COUNTS, effs, style, color=color, marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(GPU_COUNTS, [str(n) for n in GPU_COUNTS])
        ax.set_ylim(0, 1.05)
        ax.axvline(gpn, color="k", lw=0.8, ls=":")
        ax.set(xlabel=f"GPUs ({gpn} per node)", title=f"{shape.name} GPT, 8 x 1024 tokens per GPU")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted weak-scaling efficiency")
    axes[1].legend(fontsize=8, loc="lower left")
    m = cal.machine
    fig.suptitle(
        f"DistributedFusedAdam on H200s: NVLink {m.intra_busbw_gbps:.0f} GB/s bus, "
        f"{m.net_gbps:g} Gb/s NIC per GPU, net step latency {m.lat_net_us:g} us "
        "(launch_scripts/scaling_model.py)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(text: str, doc: Path) -> None:
    old = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(old):
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n\n{text}\n{END}", old))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--net-gbps", type=float, default=400.0, help="NIC line rate per GPU, Gb/s")
    p.add_argument("--net-eff", type=float, default=0.9, help="share of the line rate reached")
    p.add_argument("--lat-net-us", type=float, default=10.0, help="per ring step across nodes")
    p.add_argument("--lat-intra-us", type=float, default=3.0, help="per ring step in a node")
    p.add_argument(
        "--compute-ms", type=float, default=None,
        help="1.4B forward + backward, ms (default: derived from the no-overlap row)",
    )  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), help="print one prediction (with --gpus)")
    p.add_argument("--gpus", type=int, help="GPUs for one prediction")
    p.add_argument("--hsdp", action="store_true", help="one prediction with HSDP")
    p.add_argument("--bucket-mb", type=float, default=100.0, help="for one prediction")
    p.add_argument("--write-docs", action="store_true", help=f"rewrite {DOC.name}'s block + plot")
    args = p.parse_args(argv)
    base = Machine(
        net_gbps=args.net_gbps, net_eff=args.net_eff, lat_net_us=args.lat_net_us,
        lat_intra_us=args.lat_intra_us,
    )  # fmt: skip
    cal = calibrate(base, args.compute_ms)
    if args.model:
        shape = MODELS[args.model]
        lay = Layout(args.gpus or 2, args.gpus_per_node, args.hsdp, args.bucket_mb)
        eff, step = efficiency(shape, lay, cal)
        for name, value in dataclasses.asdict(step).items():
            print(f"{name:>15}: {value:8.2f} ms")
        print(f"{'step':>15}: {step.total:8.2f} ms | efficiency {eff:.1%}")
        return
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-docs"]
    text = render(cal, base, args.gpus_per_node, "".join(f" {a}" for a in flags))
    print(text)
    if args.write_docs:
        write_docs(text, DOC)
        plot(cal, args.gpus_per_node, PLOT)
        print(f"wrote {DOC.relative_to(REPO)} and {PLOT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
