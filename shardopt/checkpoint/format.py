"""The on-disk format of a sharded checkpoint (see Note: checkpoint format in docs/design.md).

A checkpoint is a directory:
    metadata.json                 written last, by an atomic rename: its presence marks the
                                  checkpoint complete
    rank00000-of-00002.pt ...     one per rank: the fragments that rank owned, in model-space
                                  coordinates (param index + flat element range), each a dict of
                                  state tensors; loadable with torch.load(weights_only=True)
    model.pt                      optional: the model's state_dict (params are replicated)

metadata.json holds the format name and version, world size, optimizer class, per-param name,
shape and dtype, the param groups (hyperparameters, steps), each file's fragment list, the
sha256 and size of every file, and its own checksum (``shardopt.checkpoint.metadata``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shardopt.zero.layout import Range

METADATA = "metadata.json"  # its encoding and checks: shardopt/checkpoint/metadata.py
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
    """Writes via ``write(file)`` to a temporary name, fsyncs, and renames into place.

    Raises:
        CheckpointError: naming ``path`` and the OS error; for a full disk (ENOSPC, EDQUOT) the
            directory and its free bytes, also where torch's zip writer hides the OS error
            behind "enforce fail at inline_container.cc".
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) leaves nothing behind
        os_error = _os_error(e)
        if os_error is None:
            raise
        if os_error.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free
            raise CheckpointError(
                f"{path}: no space left on the disk of {path.parent} "
                f"({errno.errorcode[os_error.errno]}, {free} bytes free); free space or save "
                "elsewhere"
            ) from e
        raise CheckpointError(f"{path}: cannot write: {os_error.strerror or os_error}") from e
    _fsync_dir(path.parent)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.save raises RuntimeError with it as the context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def save_tensors(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Atomically torch.saves ``payload``; returns its checksum entry."""
    atomic_write(path, lambda f: torch.save(payload, f))
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


#: what ``unreachable`` says of a path that is not there at all (no dangling link either)
MISSING = "missing"


def unreachable(path: Path) -> str | None:
    """Why ``path`` cannot be opened: ``MISSING``, "a symlink loop", "a dangling symlink to
    ...", or the OS error; None when it can (``Path.exists`` says False to all of these)."""
    try:
        path.stat()
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop (it cannot be followed)"
        if e.errno == errno.ENOENT and path.is_symlink():
            return f"a dangling symlink to {os.readlink(path)}, which does not exist"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return MISSING
        return f"unreadable: {e.strerror or e}"


def verify_file(directory: Path, name: str, metadata: dict[str, Any]) -> Path:
    """Checks that a listed file exists and matches its size and checksum."""
    path = Path(directory) / name
    entry = metadata["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {METADATA}")
    problem = unreachable(path)
    if problem == MISSING:
        raise CheckpointError(f"{path}: missing file (listed in {METADATA})")
    if problem is not None:
        raise CheckpointError(f"{path}: cannot be read: it is {problem} (listed in {METADATA})")
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


def check_payload(file: Path, payload: Any, listed: list) -> None:
    """A rank file holds exactly the fragments its metadata entry lists, each state tensor one
    value per element of its range."""
    frags = payload.get("fragments") if isinstance(payload, dict) else None
    if not isinstance(frags, list) or not all(isinstance(f, dict) for f in frags):
        raise CheckpointError(f"{file}: holds no fragment list")
    held = [[f.get("param"), f.get("start"), f.get("end")] for f in frags]
    if held != listed:
        raise CheckpointError(
            f"{file}: holds other fragments than {METADATA} lists for it ({len(held)} vs "
            f"{len(listed)}): the metadata does not describe this file"
        )
    for (i, start, end), f in zip(listed, frags):
        for n, t in f.items():
            if torch.is_tensor(t) and (t.dim() != 1 or t.numel() != end - start):
                raise CheckpointError(
                    f"{file}: state '{n}' of fragment [{i}, {start}, {end}] has shape "
                    f"{tuple(t.shape)}, expected ({end - start},)"
                )


def first_gap(wanted: Range, have: list[Range]) -> Range | None:
    """The first part of ``wanted`` that no range of ``have`` covers, or None."""
    cur = wanted.start
    for r in sorted(have, key=lambda r: r.start):
        if r.start > cur:
            break
        cur = max(cur, r.end)
        if cur >= wanted.end:
            return None
    if cur >= wanted.end:
        return None
    later = [r.start for r in have if r.start > cur]
    return Range(cur, min([wanted.end, *later]))
