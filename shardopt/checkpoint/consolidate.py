"""Offline tools on a sharded checkpoint: consolidation to a plain torch.optim state dict and
inspection. No process group needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardopt.checkpoint import format as fmt
from shardopt.checkpoint import metadata as meta
from shardopt.checkpoint.format import CheckpointError
from shardopt.zero.layout import Range
from shardopt.zero.state_io import PARAM_STEPS


def consolidated_state_dict(path: str | os.PathLike) -> tuple[dict[str, Any], dict | None]:
    """(optimizer state dict in torch.optim format, model state dict or None) of a checkpoint.

    The optimizer state dict loads into the matching single-process class (FusedAdam, ...), into
    torch.optim.AdamW for Adam state, and into a DistributedFused optimizer at any world size.
    fp32 masters are kept only for low-precision params (``master_param``). Each param's
    ``step`` is its own (smaller than the group's for a param skipped while unused).
    """
    path = Path(path)
    metadata = meta.read_metadata(path)
    params = metadata["params"]
    full: dict[int, dict[str, torch.Tensor]] = {}
    have: dict[tuple[int, str], list[Range]] = {}
    for name, listed in metadata["fragments"].items():
        payload = fmt.load_file(fmt.verify_file(path, name, metadata))
        fmt.check_payload(path / name, payload, listed)
        for frag in payload["fragments"]:
            i = frag["param"]
            entry = full.setdefault(i, {})
            for key, value in frag.items():
                if not torch.is_tensor(value):
                    continue
                numel = meta.numel(params[i]["shape"])
                t = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                t[frag["start"] : frag["end"]].copy_(value)
                have.setdefault((i, key), []).append(Range(frag["start"], frag["end"]))
    for i, entry in full.items():  # every state of a saved param complete, none zero-filled
        for key in entry:
            gap = fmt.first_gap(Range(0, meta.numel(params[i]["shape"])), have[(i, key)])
            if gap is not None:
                raise CheckpointError(
                    f"{path}: state '{key}' of param {i} '{params[i]['name']}': elements "
                    f"[{gap.start}, {gap.end}) are in no fragment of the checkpoint"
                )
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for sg in metadata["param_groups"]:
        group = {k: (tuple(v) if k == "betas" else v) for k, v in sg.items()}
        # each param's own step goes into its state, as torch.optim keeps it (see Note: skipped
        # params in shardopt/zero/update_calls.py)
        own = group.pop(PARAM_STEPS, [sg["step"]] * len(sg["params"]))
        if "exp_avg_sq" in group:
            group["exp_avg_sq"] = torch.tensor(group["exp_avg_sq"], dtype=torch.float32)
        groups.append(group)
        for i, own_step in zip(sg["params"], own):
            if i not in full:
                continue
            shape = params[i]["shape"]
            entry = {k: v.view(shape) for k, v in full[i].items()}
            if meta.DTYPES[params[i]["dtype"]] not in (torch.float16, torch.bfloat16):
                entry.pop("master_param", None)
            entry["step"] = torch.tensor(float(own_step))
            state[i] = entry
    model = None
    if metadata.get("has_model"):
        model = fmt.load_file(fmt.verify_file(path, fmt.MODEL, metadata))
    return {"state": state, "param_groups": groups}, model


def _same_dir(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _refuse_inside(checkpoint: Path, out: Path) -> None:
    """Raises CheckpointError when ``out``, symlinks followed, is the checkpoint directory or lies
    inside it: writing there would replace the files being read (``metadata.json``, a rank file)
    or add strays to the checkpoint. Directories are compared by device and inode, so a bind
    mount or a second path to the same directory is caught too."""
    try:
        root = checkpoint.stat()
        target = out.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CheckpointError(f"{out}: cannot resolve the output path: {e}") from e
    for place in (target, *target.parents):
        try:
            st = place.stat()
        except OSError:
            continue  # not created yet
        if _same_dir(st, root):
            raise CheckpointError(
                f"{out}: is inside the checkpoint being read ({checkpoint}"
                f"{'' if place == target else f', as {target}'}); writing there would overwrite "
                "or add to it: give an output path outside the checkpoint directory"
            )


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    """Writes the consolidated optimizer state dict to ``out`` (and the model's, if saved, to
    ``<out stem>.model.pt``); returns the files written. Each file is written to a temporary
    name and renamed into place, so an existing file is replaced whole or not at all.

    Raises:
        CheckpointError: a bad checkpoint (see ``shardopt.checkpoint.load``), ``out`` a
            directory, ``out`` or the model's file inside the checkpoint directory (symlinks
            followed), or a path that cannot be written (the OS error; a full disk named).
    """
    out = Path(out)
    sd, model = consolidated_state_dict(path)
    model_out = out.with_name(out.stem + ".model.pt")
    for target in (out, model_out) if model is not None else (out,):
        _refuse_inside(Path(path), target)
    if out.is_dir():
        raise CheckpointError(f"{out}: is a directory; give the path of the file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out.parent}: cannot create the directory: {e.strerror}") from e
    written = [out]
    fmt.atomic_write(out, lambda f: torch.save(sd, f))
    if model is not None:
        fmt.atomic_write(model_out, lambda f: torch.save(model, f))
        written.append(model_out)
    return written


def inspect(path: str | os.PathLike) -> str:
    """A readable summary: world size, params, dtypes, bytes, steps, and an integrity check."""
    path = Path(path)
    metadata = meta.read_metadata(path)
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
