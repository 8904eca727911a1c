"""The training example's optimizer (train_gpt.py): the optimizer choices and their defaults,
the optimizer the flags ask for, and the learning-rate schedule."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch
from gpt import GPT

import shardopt

# -- optimizer choices ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A shardopt optimizer family and the defaults that train the tiny model well."""

    class_name: str  # the single-process class; the ZeRO class is "Distributed" + class_name
    lr: float
    weight_decay: float
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


OPTIMIZERS = {
    "adam": OptimizerSpec("FusedAdam", lr=1e-2, weight_decay=0.1, kwargs={"betas": (0.9, 0.95)}),
    "lamb": OptimizerSpec("FusedLAMB", lr=1e-2, weight_decay=0.01),
    "novograd": OptimizerSpec(
        "FusedNovoGrad", lr=0.3, weight_decay=1e-3, kwargs={"betas": (0.95, 0.98)}
    ),
    "sgd": OptimizerSpec("FusedSGD", lr=0.3, weight_decay=0.0, kwargs={"momentum": 0.9}),
    "adagrad": OptimizerSpec("FusedAdagrad", lr=3e-2, weight_decay=0.0),
    # Muon on the hidden matrices, AdamW (adam's betas) on the rest (shardopt.muon_param_groups);
    # "match_rms_adamw" scales Muon's update to AdamW's RMS, so one lr and one schedule serve both
    # parts (docs/muon.md, "Learning rates")
    "muon": OptimizerSpec(
        "FusedMuon", lr=1e-2, weight_decay=0.1, kwargs={"adjust_lr_fn": "match_rms_adamw"}
    ),
}


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
    groups = _param_groups(args, model)
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


def _param_groups(args: argparse.Namespace, model: GPT) -> list[dict]:
    """The model's param groups for ``args.optimizer``: Muon's split (hidden matrices to Muon,
    embeddings, the head and 1-D params to AdamW, norms and biases without decay), else decay
    on matrices and embeddings only."""
    if args.optimizer != "muon":
        return model.param_groups(args.weight_decay)
    groups = shardopt.muon_param_groups(
        model, adamw_lr=args.lr, adamw_betas=OPTIMIZERS["adam"].kwargs["betas"]
    )
    out = []
    for group in groups:
        if group["use_muon"]:
            out.append(dict(group, weight_decay=args.weight_decay))
            continue
        rest = dict(group)
        params = rest.pop("params")
        out.append(dict(rest, params=[p for p in params if p.dim() >= 2]))
        out[-1]["weight_decay"] = args.weight_decay
        out.append(dict(rest, params=[p for p in params if p.dim() < 2], weight_decay=0.0))
    return [g for g in out if g["params"]]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then constant or cosine decay to lr/10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = args.lr / 10
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (args.lr - min_lr)
