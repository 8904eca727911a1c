"""The training example's process setup (train_gpt.py): the distributed environment, the
optimizer the flags ask for and the learning-rate schedule."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import torch
import torch.distributed as dist
from gpt import GPT
from train_cli import OPTIMIZERS

import shardopt

# -- distributed setup ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Env:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str, threads: int | None = None) -> Env:
    """Initialises the process group: NCCL + cuda:LOCAL_RANK on GPUs, gloo on CPU.

    Without torchrun (plain ``python``) it is a group of one on an in-memory store. On CPU each
    rank uses ``threads`` intra-op threads (None: its share of the cores of this node).
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        backend = "nccl"
    else:
        device = torch.device("cpu")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(threads or max(1, (cpus or 1) // local_world_size))
        backend = "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Env(rank, world_size, local_rank, local_world_size, device)


# -- optimizer, schedule --------------------------------------------------------------------------


def build_optimizer(args: argparse.Namespace, model: GPT) -> torch.optim.Optimizer:
    """The ZeRO optimizer, or with ``--baseline ddp`` the single-process one.

    With ``--hsdp`` the ZeRO optimizer shards within groups of ``--shard-size`` consecutive ranks
    (default: the processes of one node) and replicates across them.
    """
    spec = OPTIMIZERS[args.optimizer]
    kwargs = dict(spec.kwargs, lr=args.lr)
    if args.optimizer == "lamb":
        kwargs["max_grad_norm"] = args.clip  # LAMB clips the global norm itself (0 = off)
    groups = model.param_groups(args.weight_decay)
    if args.baseline == "ddp":
        return getattr(shardopt, spec.class_name)(groups, **kwargs)
    name = "Distributed" + spec.class_name
    if not hasattr(shardopt, name):
        raise SystemExit(f"this shardopt has no {name}; run with --baseline ddp")
    if args.state_format is not None:
        kwargs["state_format"] = args.state_format
    if args.offload is not None:
        kwargs["offload"] = shardopt.CPUOffload(fraction=args.offload)
    if args.hsdp:
        from shardopt.zero import hsdp_groups

        kwargs.update(hsdp_groups(args.shard_size)._asdict())
    return getattr(shardopt, name)(groups, **kwargs)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then constant or cosine decay to lr/10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = args.lr / 10
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (args.lr - min_lr)
