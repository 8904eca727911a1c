"""``metadata.json`` of a sharded checkpoint: its encoding, its own checksum, and its checks.

The metadata (format name and version, world size, optimizer class, per-param name, shape and
dtype, the param groups, each rank file's fragment list, every file's sha256 and size) is the
one file the rank files' checksums cannot vouch for, so from format version 2 on it carries its
own: ``checksum`` is the sha256 of the canonical JSON of every other key (sorted keys, no
whitespace), so a changed digit or a dropped entry anywhere is a CheckpointError at load.
Version 1 (no checksum) still loads. ``read_metadata`` checks the type and range of every entry
that load, consolidation and inspection read, so bad metadata is a CheckpointError naming the
entry, never a Python error deeper in.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from shardopt.checkpoint.format import METADATA, MISSING, CheckpointError, atomic_write, unreachable

FORMAT = "shardopt-checkpoint"
VERSION = 2  # 2: metadata.json carries its own checksum
OLDEST_VERSION = 1
CHECKSUM = "checksum"

#: param dtypes a checkpoint can name
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

_SCHEMA = {
    "format": str,
    "version": int,
    "world_size": int,
    "optimizer": str,
    "state_names": list,
    "params": list,
    "param_groups": list,
    "fragments": dict,
    "files": dict,
    "has_model": bool,
}
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


def _checksum(metadata: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of every key but ``checksum`` (of the parsed values, so the
    writer and the reader hash the same text)."""
    rest = {k: v for k, v in metadata.items() if k != CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def encode_signed(metadata: dict[str, Any], where: str | Path) -> bytes:
    """The JSON text of a checkpoint's metadata with its ``checksum`` added."""
    parsed = json.loads(encode_metadata(metadata, where))
    parsed[CHECKSUM] = _checksum(parsed)
    return encode_metadata(parsed, where)


def write_metadata_text(directory: Path, text: bytes) -> None:
    """Publishes a checkpoint: its metadata, written last, by an atomic rename."""
    atomic_write(directory / METADATA, lambda f: f.write(text))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def validate_metadata(metadata: Any, path: Path) -> None:
    """Raises CheckpointError naming the first malformed entry of a metadata.json: the type of
    every key, every param's name, shape and dtype, every group's params and steps, every
    fragment's param and range, every file's checksum entry."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed metadata: {what}")

    if not isinstance(metadata, dict):
        raise bad(f"not a JSON object but a {type(metadata).__name__}")
    for key, kind in _SCHEMA.items():
        if key not in metadata:
            raise bad(f"missing key '{key}'")
        value = metadata[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"'{key}' must be a {kind.__name__}, got {value!r}")
    if metadata["world_size"] < 1:
        raise bad(f"'world_size' must be >= 1, got {metadata['world_size']}")
    if not all(isinstance(n, str) for n in metadata["state_names"]):
        raise bad(f"'state_names' must be a list of strings, got {metadata['state_names']!r}")
    sizes = []
    for i, p in enumerate(metadata["params"]):
        if not isinstance(p, dict) or not {"name", "shape", "dtype"} <= set(p):
            raise bad(f"param {i} must have name, shape and dtype")
        if not isinstance(p["name"], str):
            raise bad(f"param {i}: name must be a string, got {p['name']!r}")
        shape = p["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"param {i}: shape must be a list of sizes >= 0, got {shape!r}")
        if not isinstance(p["dtype"], str) or p["dtype"] not in DTYPES:
            raise bad(
                f"param {i}: unknown dtype {p['dtype']!r} (one of {', '.join(DTYPES)} expected)"
            )
        sizes.append(numel(shape))
    for i, g in enumerate(metadata["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise bad(f"param group {i} has no params list")
        if not all(_is_int(q) and 0 <= q < len(sizes) for q in g["params"]):
            raise bad(f"param group {i}: params must be param indices, got {g['params']!r}")
        step = g.get("step")
        if not _is_number(step) or step < 0:
            raise bad(f"param group {i}: step must be a number >= 0, got {step!r}")
        own = g.get("param_steps")
        if own is not None and not (
            isinstance(own, list)
            and len(own) == len(g["params"])
            and all(_is_number(s) and 0 <= s <= step for s in own)
        ):
            raise bad(
                f"param group {i}: param_steps must be one step in [0, {step}] per param, got "
                f"{own!r}"
            )
        betas = g.get("betas")
        if betas is not None and not (
            isinstance(betas, list)
            and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise bad(f"param group {i}: betas must be two numbers in [0, 1), got {betas!r}")
    for name, entry in metadata["files"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
            and _is_int(entry.get("bytes"))
            and entry["bytes"] >= 0
        ):
            raise bad(f"files entry {name!r} must be {{'sha256': hex digest, 'bytes': size}}")
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise bad(f"files entry {name!r} is not a file name inside the checkpoint")
    for name, frags in metadata["fragments"].items():
        if name not in metadata["files"]:
            raise bad(f"fragments of {name!r}: the file is not listed in 'files'")
        if not isinstance(frags, list):
            raise bad(f"fragments of {name!r} must be a list, got {frags!r}")
        for f in frags:
            if not (isinstance(f, list) and len(f) == 3 and all(_is_int(v) for v in f)):
                raise bad(f"fragment {f!r} of {name} must be [param, start, end]")
            i, start, end = f
            if not (0 <= i < len(sizes) and 0 <= start <= end <= sizes[i]):
                raise bad(
                    f"fragment {f!r} of {name}: not a range of a param (param {i} of "
                    f"{len(sizes)}, elements [{start}, {end}))"
                )


def read_metadata(directory: Path) -> dict[str, Any]:
    """Reads and checks metadata.json; clear errors for incomplete, foreign, newer, damaged or
    malformed checkpoints."""
    directory = Path(directory)
    if not directory.is_dir():
        problem = unreachable(directory)
        if problem is None:
            raise CheckpointError(f"{directory}: not a directory (a checkpoint is a directory)")
        if problem == MISSING:
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        raise CheckpointError(f"{directory}: the checkpoint directory is {problem}")
    path = directory / METADATA
    problem = unreachable(path)
    if problem == MISSING:
        raise CheckpointError(
            f"{directory}: incomplete checkpoint: {METADATA} is missing (the save was interrupted "
            "or is still running); use an earlier checkpoint"
        )
    if problem is not None:
        raise CheckpointError(f"{path}: cannot be read: it is {problem}")
    try:
        metadata = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable metadata (not JSON text): {e}") from e
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{path}: malformed metadata: not a JSON object but a {type(metadata).__name__}"
        )
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a shardopt checkpoint (format {metadata.get('format')!r})"
        )
    version = metadata.get("version")
    if not _is_int(version) or version < OLDEST_VERSION:
        raise CheckpointError(
            f"{path}: malformed metadata: 'version' must be an integer >= {OLDEST_VERSION}, got "
            f"{version!r}"
        )
    if version > VERSION:
        raise CheckpointError(
            f"{path}: format version {version} is newer than this shardopt reads (up to "
            f"{VERSION}); upgrade shardopt"
        )
    if CHECKSUM in metadata or version >= 2:
        saved = metadata.get(CHECKSUM)
        if not isinstance(saved, str):
            raise CheckpointError(
                f"{path}: malformed metadata: no '{CHECKSUM}' (format version {version} has one)"
            )
        if saved != _checksum(metadata):
            raise CheckpointError(
                f"{path}: checksum mismatch: {METADATA} was changed or damaged after it was written"
            )
    validate_metadata(metadata, path)
    return metadata
