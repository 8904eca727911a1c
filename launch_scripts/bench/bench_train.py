"""Training-step benchmark: shardopt's ZeRO optimizers against DDP, torch's ZeRO and FSDP2.

One run trains the same GPT-like model (about 1.4B params by default) for a few steps in every mode,
rebuilding the model per mode, and measures per mode the median training step (forward, backward,
optimizer step and zero_grad between CUDA events), the optimizer step alone (after grad sync:
shardopt's finish_grad_sync() is called before it, as DDP and FSDP2 finish theirs in backward),
the peak memory per GPU and the global tokens/s; plus the reduce-scatter and all-gather bus
bandwidth of the collective library at the full gradient size in one call, and at the engine's
bucket size, 4x and 16x that (one bucket alone, and the full gradient split into such buckets)::

    torchrun --standalone --nproc-per-node 2 launch_scripts/bench/bench_train.py \\
        --out bench_train.json
    torchrun --standalone --nproc-per-node 2 launch_scripts/bench/bench_train.py --device cpu \\
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
  ddp_muon, shardopt_muon, deepspeed_zero2_muon   Muon on the hidden matrices, AdamW on the
                         rest: DDP + torch.optim.Muon + fused AdamW, DistributedFusedMuon,
                         DeepSpeed ZeRO-2's "muon" (bench_train_muon_modes.py)

With overlap_param_sync the all-gathers finish in the next forward: the optimizer-step time then
excludes them, the training-step time includes them. A mode that raises is reported and skipped.
NCCL settings are whatever the environment holds.

The parts: bench_train_model.py (the GPT), bench_train_modes.py and bench_train_muon_modes.py
(the modes), bench_train_run.py (one mode's measurement), bench_train_collectives.py,
bench_train_report.py (tables); this file is the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    environment,
    write_json,
)
from bench_train_collectives import bench_collective, engine_bucket_cap_mb
from bench_train_model import ModelConfig, count_params
from bench_train_modes import BIG_BUCKET_SCALE, DEFAULT_MODES, MODES
from bench_train_muon_modes import MUON_MODES
from bench_train_report import collective_table, mode_table
from bench_train_run import run_mode_safely

MODES.update(MUON_MODES)  # run when --modes names them

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
