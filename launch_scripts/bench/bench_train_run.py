"""bench_train.py's measurement of one mode: warmup, timed steps (eager or CUDA-graph), peak
memory, and a failure that does not end the run."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    Interval,
    free_memory,
)
from bench_train_env import GIB
from bench_train_model import GPT, ModelConfig
from bench_train_modes import MODES, Setup, release

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
