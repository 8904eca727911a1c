"""The training example's processes (train_gpt.py): where this process runs, and the process
group it joins."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


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
