"""The step-time model's inputs (scaling_model.py): what was measured on 2 x H200
(docs/benchmarks.md), the model shapes, the machine and the sharding layout."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
