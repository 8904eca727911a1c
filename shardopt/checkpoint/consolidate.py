"""Offline tools on a sharded checkpoint: consolidation to a plain torch.optim state dict and
inspection. No process group needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardopt.checkpoint import format as fmt
from shardopt.checkpoint.format import CheckpointError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def consolidated_state_dict(path: str | os.PathLike) -> tuple[dict[str, Any], dict | None]:
    """(optimizer state dict in torch.optim format, model state dict or None) of a checkpoint.

    The optimizer state dict loads into the matching single-process class (FusedAdam, ...), into
    torch.optim.AdamW for Adam state, and into a DistributedFused optimizer at any world size.
    fp32 masters are kept only for low-precision params (``master_param``).
    """
    path = Path(path)
    metadata = fmt.read_metadata(path)
    params = metadata["params"]
    full: dict[int, dict[str, torch.Tensor]] = {}
    for name in metadata["fragments"]:
        payload = fmt.load_file(fmt.verify_file(path, name, metadata))
        for frag in payload["fragments"]:
            i = frag["param"]
            numel = 1
            for d in params[i]["shape"]:
                numel *= d
            entry = full.setdefault(i, {})
            for key, value in frag.items():
                if not torch.is_tensor(value):
                    continue
                t = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                t[frag["start"] : frag["end"]].copy_(value)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for sg in metadata["param_groups"]:
        group = {k: (tuple(v) if k == "betas" else v) for k, v in sg.items()}
        if "exp_avg_sq" in group:
            group["exp_avg_sq"] = torch.tensor(group["exp_avg_sq"], dtype=torch.float32)
        groups.append(group)
        for i in sg["params"]:
            if i not in full:
                continue
            shape = params[i]["shape"]
            entry = {k: v.view(shape) for k, v in full[i].items()}
            if _DTYPES[params[i]["dtype"]] not in (torch.float16, torch.bfloat16):
                entry.pop("master_param", None)
            entry["step"] = torch.tensor(float(sg["step"]))
            state[i] = entry
    model = None
    if metadata.get("has_model"):
        model = fmt.load_file(fmt.verify_file(path, fmt.MODEL, metadata))
    return {"state": state, "param_groups": groups}, model


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    """Writes the consolidated optimizer state dict to ``out`` (and the model's, if saved, to
    ``<out stem>.model.pt``); returns the files written."""
    sd, model = consolidated_state_dict(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out]
    fmt.atomic_write(out, lambda f: torch.save(sd, f))
    if model is not None:
        model_out = out.with_name(out.stem + ".model.pt")
        fmt.atomic_write(model_out, lambda f: torch.save(model, f))
        written.append(model_out)
    return written


def inspect(path: str | os.PathLike) -> str:
    """A readable summary: world size, params, dtypes, bytes, steps, and an integrity check."""
    path = Path(path)
    metadata = fmt.read_metadata(path)
    lines = [
        f"checkpoint {path}",
        f"  format {metadata['format']} v{metadata['version']}, saved by {metadata['optimizer']} "
        f"at world size {metadata['world_size']}",
        f"  state: {', '.join(metadata['state_names'])} (+ fp32 masters)",
    ]
    for gi, g in enumerate(metadata["param_groups"]):
        lines.append(f"  group {gi}: step {g['step']}, lr {g.get('lr')}, {len(g['params'])} params")
    numel = 0
    for i, p in enumerate(metadata["params"]):
        n = 1
        for d in p["shape"]:
            n *= d
        numel += n
        lines.append(f"  param {i:4d} {p['name']:40s} {str(tuple(p['shape'])):20s} {p['dtype']}")
    total = sum(e["bytes"] for e in metadata["files"].values())
    lines.append(
        f"  {len(metadata['params'])} params, {numel} elements, {total} bytes in "
        f"{len(metadata['files'])} files"
    )
    problems = []
    for name in metadata["files"]:
        try:
            fmt.verify_file(path, name, metadata)
        except CheckpointError as e:
            problems.append(str(e))
    lines.append("  integrity: OK" if not problems else "  integrity: FAILED")
    lines += [f"    {p}" for p in problems]
    return "\n".join(lines)
