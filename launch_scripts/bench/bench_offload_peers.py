"""The contenders of bench_offload.py: how each peer builds its trainer for the GPT of gpt.py.

Every contender trains the same GPT (random tokens, AdamW, lr 1e-4, weight decay 0.1 on every
param) with bf16 params, except where a peer has no fp32 master of a bf16 param (torch's AdamW,
FSDP2): those keep fp32 params and compute in bf16 (autocast, or FSDP2's ``MixedPrecisionPolicy``),
so every contender's update is fp32 math on bf16 compute:

  fwd_bwd              forward + backward alone (no optimizer; grads dropped each step)
  cpu_update           the CPU update alone: shardopt's CPU Adam kernel over the model's param
                       count in host memory (fp32 masters and moments, bf16 grads in, bf16 params
                       out: the fused cast-out of the offload path), torch's intra-op threads
  no_offload           shardopt DistributedFusedAdam (world 1, bf16 params, fp32 masters and
                       moments on the GPU, grad and param overlap)
  torch_fused          torch.optim.AdamW(fused=True), fp32 params, bf16 autocast
  offload              DistributedFusedAdam(offload=CPUOffload(fraction=1.0))
  offload_auto         DistributedFusedAdam(offload=CPUOffload(fraction="auto"))
  offload_compact      offload with store_param_remainders=True, state_format="int8"
  deepspeed_offload    DeepSpeed ZeRO-2, bf16, offload_optimizer {device: cpu, pin_memory: true}
  fsdp2_offload        FSDP2 fully_shard (each block, then the root) with CPUOffloadPolicy
                       (pinned), MixedPrecisionPolicy(bf16 params, fp32 reduce), torch AdamW
  torchao_offload      torchao.optim.CPUOffloadOptimizer (AdamW, fused; bf16 params and bf16
                       host state: torchao keeps no fp32 master)

``build(name, ...)`` raises ``Skipped`` when a contender cannot run here (a missing package, an
API not in this shardopt, a GPU-only peer on a CPU run); its message is the reason.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# the training example's model, from its folder (see docs/design.md, Note: launch_scripts)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4
WEIGHT_DECAY = 0.1
GIB = 2**30

#: contenders that only time part of a step (no optimizer)
TIMING_ONLY = ("fwd_bwd", "cpu_update")
#: contenders that need a CUDA device
GPU_ONLY = ("deepspeed_offload", "fsdp2_offload", "torchao_offload")
CONTENDERS = (  # in the order they run (the most telling first, when a time budget cuts a run)
    "fwd_bwd",
    "cpu_update",
    "no_offload",
    "offload",
    "deepspeed_offload",
    "offload_auto",
    "offload_compact",
    "torch_fused",
    "fsdp2_offload",
    "torchao_offload",
)


def huge_pages() -> bool | None:
    """Whether shardopt's host state goes on transparent huge pages: BENCH_OFFLOAD_HUGE_PAGES
    (1 or 0), None where it is unset (CPUOffload's default)."""
    value = os.environ.get("BENCH_OFFLOAD_HUGE_PAGES")
    return None if value is None else value != "0"


class Skipped(Exception):
    """The contender cannot run here; the message says why."""


@dataclasses.dataclass
class Trainer:
    """One contender: a training step's parts and what to record about it."""

    #: (idx, targets) -> mean loss
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    #: the optimizer step and the zero_grad after it
    step: Callable[[], None]
    settings: dict[str, Any]
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    #: clips the grads to the given max norm (before ``step``); None: the peer cannot clip
    clip: Callable[[float], None] | None = None
    #: why ``clip`` is None
    clip_unsupported: str | None = None
    autocast: bool = False
    optimizer: Any = None
    #: run once at the end (removes hooks, waits for in-flight work)
    close: Callable[[], None] | None = None


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (the largest-model search)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class _LossOnly(nn.Module):
    """The GPT returning its loss alone (what DeepSpeed's engine and FSDP2's root call)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    @property
    def blocks(self) -> nn.ModuleList:
        """The GPT's blocks (a property: registered once, under ``model``)."""
        return self.model.blocks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)[1]


def model_config(width: int, depth: int, vocab: int, seq: int) -> GPTConfig:
    """The GPT of ``depth`` blocks of ``width``; heads of 128 channels (one for tiny widths)."""
    heads = max(1, width // 128)
    while width % heads:
        heads -= 1
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=depth, n_head=heads, n_embd=width)


def count_params(cfg: GPTConfig) -> int:
    """Parameters of the GPT (tied embeddings once), counted on the meta device."""
    with torch.device("meta"):
        return GPT(cfg).num_params()


def build_model(
    cfg: GPTConfig, device: torch.device, dtype: torch.dtype, checkpointing: bool
) -> _LossOnly:
    """The GPT made directly in ``dtype`` on ``device`` (no fp32 copy of a bf16 model)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
    if checkpointing:
        model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)
    return _LossOnly(model)


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


# -- shardopt -------------------------------------------------------------------------------------


def _shardopt(
    model: nn.Module, offload: Any, overlap_backward: bool = False, **storage: Any
) -> Trainer:
    import shardopt

    kwargs: dict[str, Any] = dict(storage)
    if offload is not None:
        if not hasattr(shardopt, "CPUOffload"):
            raise Skipped("this shardopt has no CPU offload (shardopt.CPUOffload is missing)")
        # updates during backward only where the step does not clip (exact only then)
        # BENCH_OFFLOAD_THREADS: the update's CPU threads (default: CPUOffload's);
        # BENCH_OFFLOAD_HUGE_PAGES=1/0: CPUOffload(huge_pages=True/False) (default: CPUOffload's)
        # BENCH_OFFLOAD_SWITCH_INTERVAL=S|none: CPUOffload(switch_interval=S|None)
        # BENCH_OFFLOAD_BUCKET_MB=M: bucket_cap_mb=M (default: the optimizer's 100), fewer and
        # larger buckets for the worker's per-bucket costs, larger staging slots
        # BENCH_OFFLOAD_SLOTS=N: CPUOffload(staging_slots=N) (default: CPUOffload's)
        threads = os.environ.get("BENCH_OFFLOAD_THREADS")
        huge = huge_pages()
        extra: dict[str, Any] = {} if huge is None else {"huge_pages": huge}
        interval = os.environ.get("BENCH_OFFLOAD_SWITCH_INTERVAL")
        if interval:
            extra["switch_interval"] = None if interval == "none" else float(interval)
        slots = os.environ.get("BENCH_OFFLOAD_SLOTS")
        if slots:
            extra["staging_slots"] = int(slots)
        kwargs["offload"] = shardopt.CPUOffload(
            fraction=offload,
            overlap_backward=overlap_backward,
            threads=int(threads) if threads else None,
            **extra,
        )
        bucket_mb = os.environ.get("BENCH_OFFLOAD_BUCKET_MB")
        if bucket_mb:
            kwargs["bucket_cap_mb"] = float(bucket_mb)
    try:
        opt = shardopt.DistributedFusedAdam(
            model.parameters(),
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            overlap_grad_sync=True,
            overlap_param_sync=True,
            **kwargs,
        )
    except TypeError as e:  # an older shardopt without the keyword
        raise Skipped(f"DistributedFusedAdam({', '.join(kwargs)}): {e}") from e

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def close() -> None:
        nn.Identity()(torch.zeros(()))  # a module call drains the overlapped param sync
        opt.close()

    settings = {"params": "bf16", "offload_fraction": offload, "bucket_cap_mb": opt.bucket_cap_mb}
    settings.update(storage)
    return Trainer(model, step, settings, clip=opt.clip_grad_norm, optimizer=opt, close=close)


# -- peers ----------------------------------------------------------------------------------------


def _torch_fused(model: nn.Module) -> Trainer:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def clip(max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    settings = {"params": "fp32", "autocast": "bf16", "fused": True}
    return Trainer(model, step, settings, clip=clip, autocast=True, optimizer=opt)


def _deepspeed(model: nn.Module, batch: int) -> Trainer:
    try:
        import deepspeed
    except ImportError as e:
        raise Skipped(f"deepspeed does not import: {e}") from e
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        # the norm is taken with offload whatever this is (DeepSpeed refuses offload without
        # it); the clip phase sets the optimizer's clip_grad, which scales the CPU update
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )

    def clip(max_norm: float) -> None:
        opt.clip_grad = max_norm  # read by the next step's unscale-and-clip

    settings = {
        "deepspeed": deepspeed.__version__,
        "zero_stage": 2,
        "bf16": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "bucket_bytes": 5e8,
    }
    return Trainer(
        engine, engine.step, settings, backward=engine.backward, clip=clip, optimizer=opt
    )


def _fsdp2(model: nn.Module) -> Trainer:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def clip(max_norm: float) -> None:
        # the sharded grads are CPU DTensors: the norm's all-reduce runs on the process group's
        # gloo backend (the worker initialises "cpu:gloo,cuda:nccl" for this contender)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    settings = {
        "params": "fp32 (host)",
        "mp_policy": "bf16 params, fp32 reduce",
        "offload_policy": "CPUOffloadPolicy(pin_memory=True)",
        "fused": True,
    }
    return Trainer(model, step, settings, clip=clip, optimizer=opt)


def _torchao(model: nn.Module) -> Trainer:
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as e:
        raise Skipped(f"torchao's CPUOffloadOptimizer does not import: {e}") from e
    opt = CPUOffloadOptimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
    )

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    settings = {"params": "bf16", "host_state": "bf16 (no fp32 master)", "fused": True}
    return Trainer(
        model,
        step,
        settings,
        clip=None,
        clip_unsupported="torchao's CPUOffloadOptimizer copies each grad to the host in "
        "backward and has no clipping",
        optimizer=opt,
    )


def _fwd_bwd(model: nn.Module) -> Trainer:
    return Trainer(model, lambda: _zero_grads(model), {"params": "bf16", "optimizer": None})


# -- building -------------------------------------------------------------------------------------


def model_dtype(name: str) -> torch.dtype:
    """The dtype the contender's params are made in."""
    return torch.float32 if name in ("torch_fused", "fsdp2_offload") else torch.bfloat16


def preimport(name: str) -> None:
    """Imports the peer's package (a missing one is found before any model is made, and its
    import's host memory is not counted as the contender's)."""
    if name == "torchao_offload":
        try:
            import torchao.optim  # noqa: F401
        except ImportError as e:
            raise Skipped(f"torchao does not import: {e}") from e
    if name == "deepspeed_offload":
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise Skipped(f"deepspeed does not import: {e}") from e


def build(
    name: str,
    cfg: GPTConfig,
    device: torch.device,
    batch: int,
    checkpointing: bool = False,
    clips: tuple[bool, ...] = (False,),
) -> Trainer:
    """The trainer of contender ``name`` over a new GPT of ``cfg`` (not ``cpu_update``); the
    shardopt offload contenders update during backward when no phase of ``clips`` clips."""
    if name in GPU_ONLY and device.type != "cuda":
        raise Skipped(f"{name} needs a CUDA device")
    preimport(name)
    model = build_model(cfg, device, model_dtype(name), checkpointing)
    if name == "fwd_bwd":
        return _fwd_bwd(model)
    if name == "no_offload":
        return _shardopt(model, None)
    during_backward = not any(clips)
    if name == "offload":
        return _shardopt(model, 1.0, during_backward)
    if name == "offload_auto":
        return _shardopt(model, "auto", during_backward)
    if name == "offload_compact":
        return _shardopt(
            model, 1.0, during_backward, store_param_remainders=True, state_format="int8"
        )
    if name == "torch_fused":
        return _torch_fused(model)
    if name == "deepspeed_offload":
        return _deepspeed(model, batch)
    if name == "fsdp2_offload":
        return _fsdp2(model)
    if name == "torchao_offload":
        return _torchao(model)
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


def backend_for(name: str, device: torch.device) -> str:
    """The process group's backend for contender ``name``."""
    if device.type != "cuda":
        return "gloo"
    # FSDP2's clip all-reduces CPU DTensors; every other contender keeps plain NCCL
    return "cpu:gloo,cuda:nccl" if name == "fsdp2_offload" else "nccl"


def offload_record(opt: Any) -> dict[str, Any]:
    """What a shardopt optimizer reports about its memory and offload plan (when it has them)."""
    out: dict[str, Any] = {}
    if hasattr(opt, "memory_bytes"):
        out["memory_gib"] = {k: v / GIB for k, v in opt.memory_bytes().items()}
    plan = getattr(opt, "offload_plan", None)
    if plan is not None:
        out["offload_plan"] = dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else plan
    return out
