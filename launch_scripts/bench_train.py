"""Training-step benchmark: shardopt's ZeRO optimizers against DDP, torch's ZeRO and FSDP2.

One run trains the same GPT-like model (about 1.4B params by default) for a few steps in every mode,
rebuilding the model per mode, and measures per mode the median training step (forward, backward,
optimizer step and zero_grad between CUDA events), the optimizer step alone (after grad sync:
shardopt's finish_grad_sync() is called before it, as DDP and FSDP2 finish theirs in backward),
the peak memory per GPU and the global tokens/s; plus the reduce-scatter and all-gather bus
bandwidth of the collective library at the full gradient size in one call, and at the engine's
bucket size, 4x and 16x that (one bucket alone, and the full gradient split into such buckets)::

    torchrun --standalone --nproc-per-node 2 launch_scripts/bench_train.py --out bench_train.json
    torchrun --standalone --nproc-per-node 2 launch_scripts/bench_train.py --device cpu \\
        --layers 2 --d-model 64 --vocab 128 --seq 32 --batch 2 --steps 3 --warmup 1

Modes (params fp32, compute under bf16 autocast, weight decay 0.1 everywhere):
  compute_floor          the same forward and backward on each GPU alone: no communication, no
                         optimizer (the floor every mode's "over floor ms" is measured from)
  ddp_adamw              DDP + torch.optim.AdamW(fused=True)
  ddp_zero               DDP + ZeroRedundancyOptimizer(AdamW, fused=True)
  fsdp2                  fully_shard(each block, then the root; reshard_after_forward=False)
                         + AdamW(fused=True)
  shardopt_adam          DistributedFusedAdam(overlap_grad_sync=False), no DDP
  shardopt_adam_overlap  DistributedFusedAdam(overlap_grad_sync=True, overlap_param_sync=True)
  shardopt_adam_overlap_big  the same with buckets of 4 x the bucket cap (fewer, larger
                         collectives: more bus bandwidth, more transient grad memory)
  shardopt_adam_graph    DistributedFusedAdam(capturable=True): after the warm-up steps (eager,
                         on a side stream) one whole step (forward, backward with its
                         reduce-scatters, optimizer step with its all-gathers) is captured in a
                         CUDA graph and the timed steps are replays (CUDA only; no separate
                         optimizer time)
  shardopt_lamb          DistributedFusedLAMB (engine defaults)

Run only when --modes names them:
  deepspeed_zero2        DeepSpeed ZeRO-2 (its fused AdamW, overlap_comm, 500 MB buckets; needs
                         deepspeed installed, its ops JIT-built)
  ddp_adamw_compiled, shardopt_adam_compiled   the model under torch.compile
  shardopt_adam_scaled, shardopt_adam_int8     fp32 params, compact moments (overlap on)
  shardopt_adam_bf16, shardopt_adam_bf16_remainders, shardopt_adam_bf16_remainders_int8
                         bf16 params: fp32 masters, int16 remainders, remainders + int8 moments

With overlap_param_sync the all-gathers finish in the next forward: the optimizer-step time then
excludes them, the training-step time includes them. A mode that raises is reported and skipped.
NCCL settings are whatever the environment holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import math
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_common import (
    Interval,
    environment,
    format_table,
    free_memory,
    import_shardopt,
    write_json,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

shardopt = import_shardopt()

# torch 2.13 renamed the tensor collectives (*_single); older releases only have *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WEIGHT_DECAY = 0.1
GIB = 2**30


# -- model ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, time, channels))
        return x + self.fc2(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Decoder-only language model with untied embeddings; ``forward`` returns the mean loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def count_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


# -- modes ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """What one mode trains: the module to call, the optimizer, and its settings for the record."""

    forward: nn.Module
    opt: torch.optim.Optimizer
    settings: dict[str, Any]
    #: a framework's own backward and step (DeepSpeed's engine), else loss.backward(), opt.step()
    backward: Callable[[torch.Tensor], None] | None = None
    step: Callable[[], None] | None = None


def _ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def setup_ddp_adamw(model, device, args) -> Setup:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True)
    return Setup(_ddp(model, device), opt, {"ddp_bucket_cap_mb": 25, "fused": True})


def setup_ddp_zero(model, device, args) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = _ddp(model, device)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=args.lr,
        weight_decay=WEIGHT_DECAY,
        fused=True,
    )
    return Setup(wrapped, opt, {"ddp_bucket_cap_mb": 25, "fused": True})


def setup_fsdp2(model, device, args) -> Setup:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True)
    return Setup(model, opt, {"reshard_after_forward": False, "fused": True})


def _shardopt(cls_name: str, model, args, bucket_scale: float = 1.0, **flags) -> Setup:
    zero_args = dict(flags)
    zero_args["bucket_cap_mb"] = bucket_scale * (args.bucket_cap_mb or engine_bucket_cap_mb())
    cls = getattr(shardopt, cls_name)
    opt = cls(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, **zero_args)
    settings = {
        "bucket_cap_mb": opt.bucket_cap_mb,
        "overlap_grad_sync": opt.overlap_grad_sync,
        "overlap_param_sync": opt.overlap_param_sync,
    }
    return Setup(model, opt, settings)


def setup_shardopt_adam(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=False, overlap_param_sync=False
    )


def setup_shardopt_adam_overlap(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=True
    )


def setup_shardopt_adam_overlap_big(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam",
        model,
        args,
        bucket_scale=BIG_BUCKET_SCALE,
        overlap_grad_sync=True,
        overlap_param_sync=True,
    )


def setup_shardopt_adam_graph(model, device, args) -> Setup:
    if device.type != "cuda":
        raise RuntimeError("shardopt_adam_graph needs CUDA (it replays a CUDA graph)")
    setup = _shardopt(
        "DistributedFusedAdam",
        model,
        args,
        capturable=True,
        overlap_grad_sync=True,
        overlap_param_sync=False,
    )
    setup.settings["cuda_graph"] = True
    return setup


def _compact(model, args, params_bf16: bool, **storage) -> Setup:
    """Adam with grad and param overlap over compact storage (README: memory per parameter)."""
    if params_bf16:
        model.to(torch.bfloat16)
    setup = _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=True,
        **storage,
    )  # fmt: skip
    setup.settings.update(storage, params="bf16" if params_bf16 else "fp32")
    return setup


def setup_shardopt_adam_scaled(model, device, args) -> Setup:
    return _compact(model, args, False, with_scaled_states=True)


def setup_shardopt_adam_int8(model, device, args) -> Setup:
    return _compact(model, args, False, state_format="int8")


def setup_shardopt_adam_bf16(model, device, args) -> Setup:
    return _compact(model, args, True)


def setup_shardopt_adam_bf16_remainders(model, device, args) -> Setup:
    return _compact(model, args, True, store_param_remainders=True)


def setup_shardopt_adam_bf16_remainders_int8(model, device, args) -> Setup:
    return _compact(model, args, True, store_param_remainders=True, state_format="int8")


def setup_deepspeed_zero2(model, device, args) -> Setup:
    """DeepSpeed ZeRO stage 2 (sharded optimizer state and grads), its fused AdamW, overlapped
    reduce-scatter, 500 MB buckets (its recommended large-model settings); bf16 autocast as the
    other modes, fp32 params."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "gradient_clipping": 0.0,
        # bf16 autocast inside the engine too (else it disables the caller's: fp32 compute)
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    return Setup(
        engine,
        opt,
        {"deepspeed": deepspeed.__version__, "zero_stage": 2, "bucket_bytes": 5e8},
        backward=engine.backward,
        step=engine.step,
    )


def setup_ddp_adamw_compiled(model, device, args) -> Setup:
    setup = setup_ddp_adamw(model, device, args)
    setup.forward = torch.compile(setup.forward)
    setup.settings["compiled"] = True
    return setup


def setup_shardopt_adam_compiled(model, device, args) -> Setup:
    """torch.compile'd model; grad overlap (param sync waits in step(): no forward hooks)."""
    setup = _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=False
    )
    setup.forward = torch.compile(model)
    setup.settings["compiled"] = True
    return setup


def setup_shardopt_lamb(model, device, args) -> Setup:
    return _shardopt("DistributedFusedLAMB", model, args)


class _NoStep(torch.optim.Optimizer):
    """compute_floor's optimizer: drops the grads, updates nothing."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self, closure=None):  # noqa: D102
        return None


def setup_compute_floor(model, device, args) -> Setup:
    """The same forward and backward on each GPU alone: no communication, no optimizer."""
    return Setup(model, _NoStep(model.parameters()), {"floor": True})


MODES: dict[str, Callable[[nn.Module, torch.device, argparse.Namespace], Setup]] = {
    "compute_floor": setup_compute_floor,
    "ddp_adamw": setup_ddp_adamw,
    "ddp_zero": setup_ddp_zero,
    "fsdp2": setup_fsdp2,
    "shardopt_adam": setup_shardopt_adam,
    "shardopt_adam_overlap": setup_shardopt_adam_overlap,
    "shardopt_adam_overlap_big": setup_shardopt_adam_overlap_big,
    "shardopt_adam_graph": setup_shardopt_adam_graph,
    "shardopt_lamb": setup_shardopt_lamb,
}
DEFAULT_MODES = list(MODES)
# peers and variants run when --modes names them: DeepSpeed (not installed by default), compiled
MODES.update(
    deepspeed_zero2=setup_deepspeed_zero2,
    ddp_adamw_compiled=setup_ddp_adamw_compiled,
    shardopt_adam_compiled=setup_shardopt_adam_compiled,
)
# compact storage (README: memory per parameter), run when --modes names them
MODES.update(
    shardopt_adam_scaled=setup_shardopt_adam_scaled,
    shardopt_adam_int8=setup_shardopt_adam_int8,
    shardopt_adam_bf16=setup_shardopt_adam_bf16,
    shardopt_adam_bf16_remainders=setup_shardopt_adam_bf16_remainders,
    shardopt_adam_bf16_remainders_int8=setup_shardopt_adam_bf16_remainders_int8,
)
BIG_BUCKET_SCALE = 4  # shardopt_adam_overlap_big: buckets of 4x the bucket cap


def release(opt: torch.optim.Optimizer | None) -> None:
    """Lets a shardopt optimizer be freed: drains its param sync, removes its grad hooks.

    With ``overlap_param_sync`` the all-gathers are waited for in a global module forward
    pre-hook, so any module call finishes them. The engine's post-accumulate-grad hooks (bound
    methods of the optimizer, stored on the params it holds) form a cycle through the tensors
    that ``gc`` does not collect: without removing them, each shardopt mode would keep its model,
    buffers and state alive into the next mode.
    """
    if opt is None or not hasattr(opt, "overlap_param_sync"):
        return
    nn.Identity()(torch.zeros(()))
    opt.close()


# -- one mode -------------------------------------------------------------------------------------


def run_mode(name: str, cfg: ModelConfig, device: torch.device, args) -> dict[str, Any]:
    """Builds the model and optimizer of one mode, trains warm-up + timed steps, measures."""
    free_memory(device)
    cuda = device.type == "cuda"
    start_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    setup = None
    try:
        setup = MODES[name](model, device, args)
        return train(setup, cfg, device, args, start_bytes)
    finally:
        release(setup.opt if setup is not None else None)


def train(setup: Setup, cfg: ModelConfig, device: torch.device, args, start_bytes: int):
    generator = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    idx, targets = (
        torch.randint(cfg.vocab, (args.batch, cfg.seq), device=device, generator=generator)
        for _ in range(2)
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        built_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    step_timer, opt_timer = Interval(device), Interval(device)
    if setup.settings.get("cuda_graph"):
        losses = train_graph(setup, idx, targets, args, step_timer)
    else:
        losses = train_eager(setup, idx, targets, device, args, step_timer, opt_timer)
    result: dict[str, Any] = {
        "step_ms": step_timer.median_ms(),
        "opt_ms": opt_timer.median_ms(),
        "losses": [float(x) for x in losses],
        "settings": setup.settings,
    }
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["built_gib"] = built_bytes / GIB
        result["start_gib"] = start_bytes / GIB  # left over from earlier modes: should be ~0
    if hasattr(setup.opt, "memory_bytes"):
        result["optimizer_gib"] = {k: v / GIB for k, v in setup.opt.memory_bytes().items()}
    return result


def train_eager(
    setup: Setup,
    idx,
    targets,
    device: torch.device,
    args,
    step_timer: Interval,
    opt_timer: Interval,
) -> list[torch.Tensor]:
    """Warm-up then timed steps, eagerly; returns the losses."""
    losses = []
    for it in range(args.warmup + args.steps):
        timed = it >= args.warmup
        if timed:
            step_timer.start()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = setup.forward(idx, targets)
        (setup.backward or torch.Tensor.backward)(loss)
        if hasattr(setup.opt, "finish_grad_sync"):
            # DDP and FSDP2 finish grad sync inside backward; end ours here too, so "opt" is the
            # step after grad sync for every mode (step_ms is unaffected)
            setup.opt.finish_grad_sync()
        if timed:
            opt_timer.start()
        if setup.step is not None:
            setup.step()  # (DeepSpeed: the step and its zero_grad)
        else:
            setup.opt.step()
        if timed:
            opt_timer.stop()
        if setup.step is None:
            setup.opt.zero_grad(set_to_none=True)
        if timed:
            step_timer.stop()
        losses.append(loss.detach())
    return losses


def train_graph(setup: Setup, idx, targets, args, step_timer: Interval) -> list[torch.Tensor]:
    """Warm-up steps on a side stream (torch's capture recipe), one step captured in a CUDA
    graph, then the timed steps as replays; returns the losses."""

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = setup.forward(idx, targets)
        loss.backward()
        setup.opt.step()
        return loss.detach()

    losses = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(args.warmup, 3)):
            losses.append(step())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for _ in range(args.steps):
        step_timer.start()
        graph.replay()
        step_timer.stop()
        losses.append(static_loss.clone())
    return losses


def run_mode_safely(name: str, cfg: ModelConfig, device: torch.device, args) -> dict[str, Any]:
    """``run_mode`` on every rank, its results gathered; an exception is reported, not raised."""
    try:
        local = run_mode(name, cfg, device, args)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        local = {"error": f"{type(exc).__name__}: {text[0] if text else ''}"}
        print(
            f"[rank {dist.get_rank()}] mode {name} failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
    free_memory(device)
    ranks = gather(local)
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(ranks) if "error" in res]
    if errors:
        return {"error": "; ".join(errors)}
    merged = dict(ranks[0])
    for key in ("step_ms", "opt_ms", "peak_gib"):
        if ranks[0].get(key) is not None:
            merged[key] = max(res[key] for res in ranks)  # the slowest / fullest rank
            merged[f"{key}_per_rank"] = [res[key] for res in ranks]
    merged["tokens_per_s"] = (
        args.batch * cfg.seq * dist.get_world_size() / (merged["step_ms"] / 1e3)
    )
    return merged


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


# -- report ---------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_table(modes: dict[str, dict[str, Any]]) -> str:
    ddp = modes.get("ddp_adamw", {})
    fsdp = modes.get("fsdp2", {})
    floor = modes.get("compute_floor", {}).get("step_ms")
    headers = [
        "mode",
        "step ms",
        "over floor ms",
        "over/ddp's",
        "opt ms",
        "peak GiB",
        "tokens/s",
        "step/ddp",
        "step/fsdp2",
        "opt/ddp",
        "mem/ddp",
        "mem/fsdp2",
    ]
    rows = []
    for name, r in modes.items():
        if "error" in r:
            continue
        over = r["step_ms"] - floor if floor is not None else None
        ddp_over = ddp["step_ms"] - floor if floor is not None and "step_ms" in ddp else None
        rows.append(
            [
                name,
                r["step_ms"],
                over,
                ratio(over, ddp_over),
                r["opt_ms"],
                r.get("peak_gib"),
                r["tokens_per_s"],
                ratio(r["step_ms"], ddp.get("step_ms")),
                ratio(r["step_ms"], fsdp.get("step_ms")),
                ratio(r["opt_ms"], ddp.get("opt_ms")),
                ratio(r.get("peak_gib"), ddp.get("peak_gib")),
                ratio(r.get("peak_gib"), fsdp.get("peak_gib")),
            ]
        )
    text = format_table(headers, rows)
    failed = [f"  {name}: {r['error']}" for name, r in modes.items() if "error" in r]
    if failed:
        text += "\nfailed:\n" + "\n".join(failed)
    return text


def collective_table(collectives: list[dict[str, Any]]) -> str:
    headers = ["size", "MB", "reduce-scatter ms", "RS busbw GB/s", "all-gather ms", "AG busbw GB/s"]
    rows = [
        [
            c["label"],
            c["bytes"] / 1e6,
            c["reduce_scatter_ms"],
            c["reduce_scatter_busbw_gbs"],
            c["all_gather_ms"],
            c["all_gather_busbw_gbs"],
        ]
        for c in collectives
    ]
    return format_table(headers, rows)


# -- main -----------------------------------------------------------------------------------------


def init_distributed(device_type: str, timeout_s: float) -> torch.device:
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python bench_train.py`: a one-process group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
        )
    return device


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstring's layout."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Run with torchrun (one process per GPU); rank 0 prints and writes the results.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="cuda (NCCL) or cpu (gloo); default: cuda when available",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated modes from {','.join(MODES)}",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per mode")
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=2048, help="model width")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--vocab", type=int, default=50304, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of every optimizer")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="shardopt bucket size (default: the engine's default)",
    )
    parser.add_argument(
        "--comm-iters", type=int, default=20, help="timed repetitions of each collective"
    )
    parser.add_argument("--no-comm", action="store_true", help="skip the collective benchmark")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600,
        help="process-group timeout: a hung collective fails after this long",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="rank 0 writes the results as JSON here (rewritten after each mode)",
    )
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    return args


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device, args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(args.layers, args.d_model, args.heads, args.vocab, args.seq)
    n_params = count_params(cfg)
    env = environment(device)
    env["world_size"] = world
    env["backend"] = str(dist.get_backend())
    env["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    bucket_cap_mb = args.bucket_cap_mb or engine_bucket_cap_mb()
    report: dict[str, Any] = {
        "environment": env,
        "args": vars(args),
        "model": {**dataclasses.asdict(cfg), "params": n_params},
        "tokens_per_step": args.batch * cfg.seq * world,
        "collectives": [],
        "modes": {},
    }
    if rank == 0:
        print(
            f"{env['date']}  {env['device_name']} x{world}  torch {env['torch']}  "
            f"cuda {env['cuda']}  commit {env['commit']}  backend {env['backend']}\n"
            f"model: {n_params:,} params ({cfg}), batch {args.batch}/rank, "
            f"{args.warmup} warm-up + {args.steps} timed steps per mode",
            flush=True,
        )
    if not args.no_comm:
        cases = [("full grads, one call", n_params, 1)]
        for cap in (bucket_cap_mb, BIG_BUCKET_SCALE * bucket_cap_mb, 16 * bucket_cap_mb):
            bucket_numel = min(int(cap * 2**20) // 4, n_params)
            buckets = math.ceil(n_params / bucket_numel)
            cases += [
                (f"one bucket ({cap:g} MB cap)", bucket_numel, 1),
                (f"full grads, {buckets} buckets of {cap:g} MB", n_params, buckets),
            ]
        for label, numel, pieces in cases:
            report["collectives"].append(
                bench_collective(label, numel, device, args.comm_iters, warmup=3, pieces=pieces)
            )
        if rank == 0:
            print(collective_table(report["collectives"]), flush=True)
    for name in args.modes:
        result = run_mode_safely(name, cfg, device, args)
        report["modes"][name] = result
        if rank == 0:
            if "error" in result:
                print(f"{name}: FAILED {result['error']}", flush=True)
            else:
                peak = result.get("peak_gib")
                print(
                    f"{name}: step {result['step_ms']:.1f} ms, "
                    + (f"opt {result['opt_ms']:.1f} ms, " if result["opt_ms"] is not None else "")
                    + (f"peak {peak:.1f} GiB, " if peak is not None else "")
                    + f"{result['tokens_per_s']:,.0f} tokens/s, "
                    f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}",
                    flush=True,
                )
            write_json(args.out, report)
        dist.barrier()
    if rank == 0:
        print(mode_table(report["modes"]), flush=True)
        write_json(args.out, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
