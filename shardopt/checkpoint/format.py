"""The on-disk format of a sharded checkpoint (see Note: checkpoint format in docs/design.md).

A checkpoint is a directory:
    metadata.json                 written last, by an atomic rename: its presence marks the
                                  checkpoint complete
    rank00000-of-00002.pt ...     one per rank: the fragments that rank owned, in model-space
                                  coordinates (param index + flat element range), each a dict of
                                  state tensors; loadable with torch.load(weights_only=True)
    model.pt                      optional: the model's state_dict (params are replicated)

metadata.json holds the format name and version, world size, optimizer class, per-param name,
shape and dtype, the param groups (hyperparameters, steps), each file's fragment list, and the
sha256 and size of every file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "shardopt-checkpoint"
VERSION = 1
METADATA = "metadata.json"
MODEL = "model.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the optimizer; names the file."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """Writes via ``write(file)`` to a temporary name, fsyncs, and renames into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) leaves nothing behind
        raise
    _fsync_dir(path.parent)


def save_tensors(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Atomically torch.saves ``payload``; returns its checksum entry."""
    atomic_write(path, lambda f: torch.save(payload, f))
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


def _to_json(value: Any) -> Any:
    """JSON form of a group value: tensors and numpy scalars/arrays become numbers and lists."""
    if torch.is_tensor(value):
        return value.tolist() if value.dim() > 0 else value.item()
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r} cannot be stored in {METADATA}")


def encode_metadata(metadata: Any, where: str | Path) -> bytes:
    """The JSON text of ``metadata`` (or of param groups); CheckpointError naming ``where`` and
    a value JSON cannot hold."""
    try:
        return json.dumps(metadata, indent=1, sort_keys=True, default=_to_json).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def write_metadata_text(directory: Path, text: bytes) -> None:
    """Publishes a checkpoint: its metadata, written last, by an atomic rename."""
    atomic_write(directory / METADATA, lambda f: f.write(text))


def write_metadata(directory: Path, metadata: dict[str, Any]) -> None:
    write_metadata_text(directory, encode_metadata(metadata, directory / METADATA))


_SCHEMA = {
    "format": str,
    "version": int,
    "world_size": int,
    "optimizer": str,
    "params": list,
    "param_groups": list,
    "fragments": dict,
    "files": dict,
    "has_model": bool,
}


def validate_metadata(metadata: Any, path: Path) -> None:
    """Raises CheckpointError naming the first malformed entry of a metadata.json."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed metadata: {what}")

    if not isinstance(metadata, dict):
        raise bad("not a JSON object")
    for key, kind in _SCHEMA.items():
        if key not in metadata:
            raise bad(f"missing key '{key}'")
        if not isinstance(metadata[key], kind):
            raise bad(f"'{key}' must be a {kind.__name__}, got {metadata[key]!r}")
    for i, p in enumerate(metadata["params"]):
        if not isinstance(p, dict) or not {"name", "shape", "dtype"} <= set(p):
            raise bad(f"param {i} must have name, shape and dtype")
    for i, g in enumerate(metadata["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise bad(f"param group {i} has no params list")
        step = g.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or step < 0:
            raise bad(f"param group {i}: step must be a number >= 0, got {step!r}")
        betas = g.get("betas")
        if betas is not None and not (
            isinstance(betas, list)
            and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
        ):
            raise bad(f"param group {i}: betas must be two numbers in [0, 1), got {betas!r}")
    for name, frags in metadata["fragments"].items():
        for f in frags:
            if not (
                isinstance(f, list) and len(f) == 3 and all(isinstance(v, int) for v in f)
            ) or not (0 <= f[1] <= f[2]):
                raise bad(f"fragment {f!r} of {name} must be [param, start, end]")


def read_metadata(directory: Path) -> dict[str, Any]:
    """Reads and checks metadata.json; clear errors for incomplete, foreign or newer checkpoints."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / METADATA
    if not path.exists():
        raise CheckpointError(
            f"{directory}: incomplete checkpoint: {METADATA} is missing (the save was interrupted "
            "or is still running); use an earlier checkpoint"
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable metadata: {e}") from e
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a shardopt checkpoint (format {metadata.get('format')!r})"
        )
    if int(metadata.get("version", -1)) > VERSION:
        raise CheckpointError(
            f"{path}: format version {metadata['version']} is newer than this shardopt reads "
            f"(up to {VERSION}); upgrade shardopt"
        )
    validate_metadata(metadata, path)
    return metadata


def verify_file(directory: Path, name: str, metadata: dict[str, Any]) -> Path:
    """Checks that a listed file exists and matches its size and checksum."""
    path = Path(directory) / name
    entry = metadata["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {METADATA}")
    if not path.exists():
        raise CheckpointError(f"{path}: missing file (listed in {METADATA})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{path}: size {size} bytes, {METADATA} says {entry['bytes']}: truncated or replaced"
        )
    if sha256(path) != entry["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupted")
    return path


def load_file(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged zip/pickle data
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
