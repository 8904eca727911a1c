"""The training example's checkpoints (train_gpt.py): full (model + optimizer state dict) or
sharded (shardopt.checkpoint) folders, found, read and written atomically."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from train_env import Env

# -- checkpoints ----------------------------------------------------------------------------------

TRAINER_FILE = "trainer.pt"  # written last: its presence marks a complete checkpoint


def sharded_checkpoint_module(optimizer: torch.optim.Optimizer) -> ModuleType | None:
    """``shardopt.checkpoint`` when it exists and the optimizer is a ZeRO one, else None."""
    if not type(optimizer).__name__.startswith("Distributed"):
        return None
    try:
        module = importlib.import_module("shardopt.checkpoint")
    except ImportError:
        return None
    return module if hasattr(module, "save") and hasattr(module, "load") else None


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    folder: str,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    env: Env,
) -> None:
    """Writes checkpoint ``folder`` (collective: every rank calls it).

    With ``shardopt.checkpoint`` every rank writes its own optimizer shards (and rank 0 the model)
    under ``folder/shards``; otherwise rank 0 writes the full model and optimizer state dicts into
    ``trainer.pt``. ``trainer.pt`` is written last, by atomic rename, and removed first, so a
    crash mid-save never leaves a folder that looks complete.
    """
    marker = os.path.join(folder, TRAINER_FILE)
    if env.is_main:
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(marker):
            os.remove(marker)
    dist.barrier()
    sharded = sharded_checkpoint_module(optimizer)
    meta = dict(trainer_state, step=step, rng=torch.get_rng_state())
    if sharded is not None:
        sharded.save(os.path.join(folder, "shards"), optimizer, model=model, overwrite=True)
        meta["format"] = "sharded"
    else:
        meta["optimizer_state"] = optimizer.state_dict()  # may gather shards: every rank calls it
        meta["model_state"] = model.state_dict()
        meta["format"] = "full"
    dist.barrier()
    if env.is_main:
        _atomic_save(meta, marker)
    dist.barrier()


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TRAINER_FILE))


def find_checkpoint(args: argparse.Namespace) -> str | None:
    """The folder ``--resume`` names; for ``latest``, the newest complete one (None if none)."""
    if args.resume != "latest":
        return args.resume
    if not os.path.isdir(args.ckpt_dir):
        return None
    steps = [
        int(name.removeprefix("step_"))
        for name in os.listdir(args.ckpt_dir)
        if name.startswith("step_") and is_checkpoint(os.path.join(args.ckpt_dir, name))
    ]
    return checkpoint_path(args, max(steps)) if steps else None


def read_checkpoint(folder: str, args: argparse.Namespace, config: GPTConfig) -> dict:
    meta = torch.load(os.path.join(folder, TRAINER_FILE), map_location="cpu", weights_only=True)
    expected = {"optimizer": args.optimizer, "model_config": dataclasses.asdict(config)}
    for key, value in expected.items():
        if meta[key] != value:
            raise SystemExit(f"checkpoint {folder} has {key}={meta[key]}, this run {value}")
    return meta


def checkpoint_path(args: argparse.Namespace, step: int) -> str:
    return os.path.join(args.ckpt_dir, f"step_{step:06d}")
