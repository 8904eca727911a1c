"""Collective sharded save and load of a DistributedFused optimizer (and optionally its model).

Each rank writes only the fragments it owns, in model-space coordinates (param index + flat
element range); loading at any world size or bucket size reads only the files whose fragments
overlap what the rank owns now. Every file is checked (size, sha256) and every rank agrees that
the checkpoint is usable before any state is changed, so a failed load loses nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

from shardopt.checkpoint import format as fmt
from shardopt.checkpoint.format import CheckpointError
from shardopt.zero import comm
from shardopt.zero.engine import DistributedOptimizer
from shardopt.zero.layout import Range

# Test hook: the rank named by SHARDOPT_CKPT_KILL_RANK is SIGKILLed right after it has written its
# rank file (used by the crash-safety test; never set in normal use).
_KILL_ENV = "SHARDOPT_CKPT_KILL_RANK"


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.tolist() if value.dim() > 0 else value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _param_names(optimizer: DistributedOptimizer, model: torch.nn.Module | None) -> list[str]:
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(optimizer.all_params)]


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            "shardopt.checkpoint saves and loads DistributedFused* optimizers; for a "
            f"single-process optimizer ({type(optimizer).__name__}) use "
            "torch.save(optimizer.state_dict())"
        )


def _agree(error: str | None, group) -> None:
    """Raises on every rank if any rank failed (so no rank goes on alone, and none hangs)."""
    errors = [e for e in comm.all_gather_object(error, group) if e]
    if errors:
        raise CheckpointError(errors[0])


def save(
    path: str | os.PathLike,
    optimizer: DistributedOptimizer,
    model: torch.nn.Module | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Saves a sharded checkpoint into directory ``path`` (collective over the optimizer's group).

    Each rank writes its own fragments (no gather to one rank); rank 0 writes ``model.pt`` (if a
    model is given) and, last, ``metadata.json`` by an atomic rename. Save each checkpoint to a
    new directory: an interrupted save then never touches the previous one.

    Args:
        path: the checkpoint directory (created; must not hold a checkpoint unless ``overwrite``).
        optimizer: a DistributedFused* optimizer.
        model: optional; its ``state_dict()`` is saved too and names the params in the metadata.
        overwrite: replace a complete checkpoint already in ``path``.

    Raises:
        CheckpointError: ``path`` already holds a checkpoint and ``overwrite`` is False.
    """
    _check_optimizer(optimizer)
    path = Path(path)
    group, rank, world = optimizer.process_group, optimizer.rank, optimizer.world_size
    error = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if (path / fmt.METADATA).exists():
                if not overwrite:
                    raise CheckpointError(
                        f"{path}: already holds a checkpoint; pass overwrite=True or use a new "
                        "directory"
                    )
                (path / fmt.METADATA).unlink()  # unpublish first: a crash leaves it incomplete
        except (OSError, CheckpointError) as e:
            error = str(e)
    _agree(error, group)
    optimizer.wait_param_sync()
    fragments, payload = [], []
    for key in optimizer.keys:
        named = dict(optimizer._shard_tensors(key))
        named["master_param"] = key.buffers.master
        for f in key.buffers.fragments:
            index = optimizer.all_index[f.param]
            entry = {"param": index, "start": f.param_range.start, "end": f.param_range.end}
            entry.update(
                {n: key.buffers.fragment(t, f).detach().cpu().clone() for n, t in named.items()}
            )
            payload.append(entry)
            fragments.append([index, f.param_range.start, f.param_range.end])
    writes = (
        optimizer.redundant_process_group is None
        or comm.rank(optimizer.redundant_process_group) == 0
    )
    name = fmt.rank_file(rank, world)
    entry = fmt.save_tensors(path / name, {"fragments": payload}) if writes else None
    if os.environ.get(_KILL_ENV) == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    gathered = comm.all_gather_object((name, entry, fragments), group)
    ids = {id(p): i for i, p in enumerate(optimizer.all_params)}
    groups = [
        _jsonable(
            {
                **{k: v for k, v in g.items() if k != "params"},
                "step": int(g["step"].item()),
                "params": [ids[id(p)] for p in g["params"]],
                **optimizer._extra_group_state(gi),
            }
        )
        for gi, g in enumerate(optimizer.param_groups)
    ]
    if rank == 0 and writes:
        files = {n: e for n, e, _ in gathered}
        if model is not None:
            files[fmt.MODEL] = fmt.save_tensors(path / fmt.MODEL, model.state_dict())
        names = _param_names(optimizer, model)
        metadata = {
            "format": fmt.FORMAT,
            "version": fmt.VERSION,
            "world_size": world,
            "optimizer": type(optimizer).__name__,
            "state_names": list(optimizer.state_names),
            "params": [
                {
                    "name": names[i],
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).replace("torch.", ""),
                    "trainable": bool(p.requires_grad),
                }
                for i, p in enumerate(optimizer.all_params)
            ],
            "param_groups": groups,
            "fragments": {n: frags for n, _, frags in gathered},
            "files": files,
            "has_model": model is not None,
        }
        fmt.write_metadata(path, metadata)
    comm.barrier()


def check_compatible(metadata: dict, optimizer: DistributedOptimizer, path: Path) -> None:
    """Raises CheckpointError listing every param whose name, shape or dtype does not match."""
    if metadata["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(
            f"{path}: saved by {metadata['optimizer']}, cannot load into {type(optimizer).__name__}"
        )
    saved = metadata["params"]
    mine = optimizer.all_params
    problems = []
    if len(saved) != len(mine):
        problems.append(f"checkpoint has {len(saved)} params, the optimizer has {len(mine)}")
    for i, (s, p) in enumerate(zip(saved, mine)):
        dtype = str(p.dtype).replace("torch.", "")
        if s["shape"] != list(p.shape) or s["dtype"] != dtype:
            problems.append(
                f"param {i} '{s['name']}': checkpoint {tuple(s['shape'])} {s['dtype']}, optimizer "
                f"{tuple(p.shape)} {dtype}"
            )
    if len(metadata["param_groups"]) != len(optimizer.param_groups):
        problems.append(
            f"checkpoint has {len(metadata['param_groups'])} param groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    if problems:
        raise CheckpointError(
            f"{path}: the checkpoint is of another model: " + "; ".join(problems[:10])
        )


def load(
    path: str | os.PathLike,
    optimizer: DistributedOptimizer,
    model: torch.nn.Module | None = None,
) -> None:
    """Loads a sharded checkpoint saved at any world size and bucket size (collective).

    Each rank verifies and reads only the files whose fragments overlap what it owns now. Nothing
    is changed unless every rank found everything it needs intact.

    Args:
        path: a checkpoint directory written by ``save``.
        optimizer: a DistributedFused* optimizer of the same class over the same params.
        model: optional; loaded from ``model.pt`` when the checkpoint has one.

    Raises:
        CheckpointError: incomplete directory, newer format, another model, a missing, truncated
            or corrupted file (the message names the file and the problem).
    """
    _check_optimizer(optimizer)
    path = Path(path)
    group = optimizer.process_group
    error, metadata, needed = None, None, []
    try:
        metadata = fmt.read_metadata(path)
        check_compatible(metadata, optimizer, path)
        mine: dict[int, list[Range]] = {}
        for key in optimizer.keys:
            for f in key.buffers.fragments:
                mine.setdefault(optimizer.all_index[f.param], []).append(f.param_range)
        for name, frags in metadata["fragments"].items():
            if any(Range(s, e).intersect(r) for i, s, e in frags for r in mine.get(i, [])):
                needed.append(fmt.verify_file(path, name, metadata))
        if model is not None and metadata.get("has_model"):
            fmt.verify_file(path, fmt.MODEL, metadata)
    except CheckpointError as e:
        error = str(e)
    _agree(error, group)

    payloads = [fmt.load_file(p) for p in needed]
    if model is not None and metadata.get("has_model"):
        model.load_state_dict(fmt.load_file(path / fmt.MODEL))
    with torch.no_grad():
        for key in optimizer.keys:
            buf = key.buffers
            named = dict(optimizer._shard_tensors(key))
            named["master_param"] = buf.master
            for f in buf.fragments:
                index = optimizer.all_index[f.param]
                for payload in payloads:
                    for saved in payload["fragments"]:
                        if saved["param"] != index:
                            continue
                        piece = Range(saved["start"], saved["end"]).intersect(f.param_range)
                        if piece is None:
                            continue
                        dst = piece.shift(f.shard_range.start - f.param_range.start)
                        src = piece.shift(-saved["start"])
                        for n, shard in named.items():
                            buf.shard_slice(shard, dst).copy_(saved[n][src.start : src.end])
        optimizer._restore_groups(metadata["param_groups"])
        optimizer._publish_masters()
