"""The contenders of bench_muon.py that run in a subprocess: heavyball's Muon compiled (in its
own torch.compile mode, and in torch's default mode) and DeepSpeed's Muon (ZeRO-2 at world 1).
bench_muon.py starts one process per peer with a time limit and reads its ``RESULT {json}``
lines; what a killed process printed still counts.

DeepSpeed applies Muon inside ZeRO: the momentum and Newton-Schulz run when the gradient
partitions are filled at the end of ``engine.backward`` (the accumulation boundary), the decay
and apply in ``engine.step``. Its row is therefore ``backward + step - plain backward``: the same
model's autograd backward without DeepSpeed, measured first, taken off. The model is one module
holding the set's params whose backward hands out the set's random grads; the params are named
so that DeepSpeed's own split (2-D and not "embed": Muon) is the benchmark's.

    python launch_scripts/bench/bench_muon_worker.py --peer deepspeed --sets gpt124m
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

import torch
from bench_common import Interval, free_memory, median, synchronize, time_fn
from bench_muon_contenders import (
    DISTRIBUTIONS,
    HEAVYBALL_MODES,
    LR,
    WEIGHT_DECAY,
    Unavailable,
    grads_lost,
    heavyball_compiled,
    version,
)
from bench_muon_sets import ADAMW, make_params, moved, set_specs, snapshot


def emit(row: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(row), flush=True)


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def heavyball_rows(args: argparse.Namespace, device: torch.device, timing: dict) -> None:
    for set_name in args.sets:
        row: dict[str, Any] = {"kind": "step", "set": set_name, "contender": args.peer}
        params = None
        try:
            params = make_params(set_specs(set_name, args.tiny, args.llama_layers), device)
            step, _ = heavyball_compiled(None, *params, mode=HEAVYBALL_MODES[args.peer])
            before = snapshot(params[0])
            times = time_fn(step, device, **timing)
            row.update(
                ms=median(times),
                min_ms=min(times),
                iters=len(times),
                moved=moved(params[0], before),
            )
            lost = grads_lost(params)
            if lost:
                row["error"] = lost
                row["invalid_ms"] = row.pop("ms")
        except Exception as exc:  # a compile failure, out of memory: the next set may still run
            row["error"] = _error(exc)
        params = step = None
        free_memory(device)
        emit(row)


class _RandomGrads(torch.autograd.Function):
    """A zero loss whose backward gives each param a copy of its preallocated random grad."""

    @staticmethod
    def forward(ctx: Any, grads: list[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        return (None, *(g.clone() for g in ctx.grads))


class RandomGradModel(torch.nn.Module):
    """The set's params, named by role for DeepSpeed's split: ``embed_i`` (AdamW, 2-D),
    ``matrix_i`` (Muon), ``vector_i`` (AdamW, 1-D)."""

    def __init__(self, specs: list, device: torch.device) -> None:
        super().__init__()
        muon, adamw = make_params(specs, device)
        pools = {True: iter(adamw), False: iter(muon)}
        self.grads = []
        for i, spec in enumerate(specs):
            p = next(pools[spec.optimizer == ADAMW])
            role = "matrix" if spec.optimizer != ADAMW else ("embed" if p.ndim > 1 else "vector")
            self.grads.append(p.grad)
            p.grad = None
            self.register_parameter(f"{role}_{i}", p)

    def forward(self) -> torch.Tensor:
        return _RandomGrads.apply(self.grads, *self.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_rows(args: argparse.Namespace, device: torch.device, timing: dict) -> None:
    try:
        import deepspeed
    except ImportError as exc:
        raise Unavailable(f"deepspeed not installed ({_error(exc)})") from exc
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    params: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if not args.deepspeed_fused_adam:
        # DeepSpeed's default AdamW half is its FusedAdam, a JIT build of a minute or more on
        # the GPU machine: torch's AdamW instead, as the other peers
        params["torch_adam"] = True
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "muon", "params": params},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    adamw = "DeepSpeed FusedAdam" if args.deepspeed_fused_adam else "torch AdamW"
    for set_name in args.sets:
        row: dict[str, Any] = {"kind": "step", "set": set_name, "contender": "deepspeed"}
        try:
            specs = set_specs(set_name, args.tiny, args.llama_layers)
            row.update(_deepspeed_set(deepspeed, config, specs, device, timing), adamw=adamw)
        except Exception as exc:  # ZeRO refusing a configuration, out of memory, a compile error
            row["error"] = _error(exc)
        free_memory(device)
        emit(row)


def _deepspeed_set(deepspeed: Any, config: dict, specs: list, device, timing: dict) -> dict:
    """DeepSpeed's median ``backward + step`` on one set, less the plain backward."""
    model = RandomGradModel(specs, device)

    def plain_backward() -> None:
        model().backward()
        for p in model.parameters():
            p.grad = None

    plain = median(time_fn(plain_backward, device, **timing))
    matrices = [p for n, p in model.named_parameters() if n.startswith("matrix")]
    before = snapshot(matrices)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=dict(config)
    )
    backward, step = Interval(device), Interval(device)

    def one_step(timed: bool) -> None:
        loss = engine()
        if timed:
            backward.start()
        engine.backward(loss)
        if timed:
            backward.stop()
            step.start()
        engine.step()
        if timed:
            step.stop()

    try:
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(timing["warmup"]):  # the first compiles DeepSpeed's Muon update
            one_step(timed=False)
        synchronize(device)
        per_step = (time.perf_counter() - begin) / max(timing["warmup"], 1)
        iters = int(timing["target_s"] / per_step) if per_step > 0 else timing["max_iters"]
        iters = max(timing["min_iters"], min(timing["max_iters"], iters))
        for _ in range(iters):
            one_step(timed=True)
        b_ms, s_ms = backward.median_ms(), step.median_ms()
        return {
            "ms": b_ms + s_ms - plain,
            "backward_ms": b_ms,
            "step_ms": s_ms,
            "plain_backward_ms": plain,
            "iters": iters,
            "moved": moved(matrices, before),
            "timed": "engine.backward + engine.step - plain backward",
        }
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer", choices=[*HEAVYBALL_MODES, "deepspeed"], required=True)
    parser.add_argument("--sets", default="gpt124m")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-iters", type=int, default=5)
    parser.add_argument("--max-iters", type=int, default=20)
    parser.add_argument("--target-s", type=float, default=0.5)
    parser.add_argument("--deepspeed-fused-adam", action="store_true")
    args = parser.parse_args()
    args.sets = [s for s in args.sets.split(",") if s]
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    timing = {
        "warmup": args.warmup,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "target_s": args.target_s,
    }
    dist = DISTRIBUTIONS[args.peer]
    try:
        (heavyball_rows if args.peer in HEAVYBALL_MODES else deepspeed_rows)(args, device, timing)
    except Unavailable as exc:
        for set_name in args.sets:
            emit({"kind": "step", "set": set_name, "contender": args.peer, "error": str(exc)})
    print(f"{args.peer} {version(dist)} done", file=sys.stderr)


if __name__ == "__main__":
    main()
