"""Collective sharded save and load of a DistributedFused optimizer (and optionally its model).

Each rank writes only the fragments it owns, in model-space coordinates (param index + flat
element range); loading at any world size or bucket size reads only the files whose fragments
overlap what the rank owns now. Every file is checked (size, sha256) and every rank agrees that
the checkpoint is usable before any state is changed, so a failed load loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch

from shardopt.checkpoint import format as fmt
from shardopt.checkpoint import metadata as meta
from shardopt.checkpoint.format import CheckpointError
from shardopt.optimizers.state_dict import check_loaded_groups
from shardopt.zero import comm
from shardopt.zero.engine import DistributedOptimizer
from shardopt.zero.layout import Range

# Test hook: the rank named by SHARDOPT_CKPT_KILL_RANK is SIGKILLed right after it has written its
# rank file (used by the crash-safety test; never set in normal use).
_KILL_ENV = "SHARDOPT_CKPT_KILL_RANK"


def _param_names(optimizer, model: torch.nn.Module | None) -> list[str]:
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


class _Ranks:
    """Who does what in a save or load, and agreement over every rank of the optimizer.

    With a ``redundant_process_group`` (HSDP) the ranks are the shard group x the replica
    group; replica 0 writes, its rank 0 (the publisher) prepares the directory and publishes.
    """

    def __init__(self, optimizer: DistributedOptimizer, call: str) -> None:
        optimizer.enter_collective(call)  # see Note: arrival check (shardopt/zero/comm.py)
        self.group = optimizer.process_group
        self.replicas = optimizer.redundant_process_group
        self.rank, self.world = optimizer.rank, optimizer.world_size
        self.writes = self.replicas is None or comm.rank(self.replicas) == 0
        self.publishes = self.writes and self.rank == 0

    def gather(self, value: Any) -> list:
        """``value`` of every rank of the shard group (each replica gathers its own)."""
        return comm.all_gather_object(value, self.group)

    def agree(self, error: BaseException | str | None, what: str) -> None:
        """Raises CheckpointError on every rank if any rank failed (none goes on alone, none
        hangs); the message names the first failing rank and its error."""
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        if error is not None:
            error = f"rank {comm.global_rank(self.group, self.rank)}: {error}"
        first = next((e for e in self.gather(error) if e), None)
        if self.replicas is not None:
            first = next((e for e in comm.all_gather_object(first, self.replicas) if e), None)
        if first is not None:
            raise CheckpointError(f"{what} failed: {first}")


def _pending(path: Path) -> Path:
    return path.with_name(f".{path.name}.pending")


def _remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def save(
    path: str | os.PathLike,
    optimizer: DistributedOptimizer,
    model: torch.nn.Module | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Saves a sharded checkpoint into directory ``path`` (collective over the optimizer's ranks).

    Each writing rank writes its own fragments (no gather to one rank); the publisher (rank 0 of
    the writing replica) writes ``model.pt`` (if a model is given) and, last, ``metadata.json``.
    Every phase ends with all ranks agreeing: if anything fails on any rank (a write error such as
    ENOSPC, a group value JSON cannot hold), every rank raises, the files of this save are
    removed and what was saved before is untouched. Save each checkpoint to a new directory.
    Once the new checkpoint is complete, the publisher removes what earlier saves into ``path``
    left: the pending and temporary files of a save that was killed, and with ``overwrite`` the
    replaced checkpoint's files the new one does not list (rank files of another world size, its
    ``model.pt``). Files of other names are never touched.

    Args:
        path: the checkpoint directory (created; must not hold a checkpoint unless ``overwrite``).
        optimizer: a DistributedFused* optimizer.
        model: optional; its ``state_dict()`` is saved too and names the params in the metadata.
        overwrite: replace a complete checkpoint already in ``path`` (it stays valid until the
            new one's files are all written).

    Raises:
        CheckpointError: on every rank, naming the first rank that failed and why.
    """
    _check_optimizer(optimizer)
    path = Path(path)
    ranks = _Ranks(optimizer, "shardopt.checkpoint.save()")
    error, replaced = None, set()
    if ranks.publishes:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if (path / fmt.METADATA).exists() and not overwrite:
                raise CheckpointError(
                    f"{path}: already holds a checkpoint; pass overwrite=True or use a new "
                    "directory"
                )
            replaced = _listed_files(path)
        except Exception as e:
            error = e
    ranks.agree(error, f"save to {path}")

    optimizer.wait_param_sync()
    name = fmt.rank_file(ranks.rank, ranks.world)
    written: list[Path] = []
    files: dict[str, Any] = {}
    error, entry, fragments, text = None, None, [], None
    try:
        payload = []
        for frag in optimizer.shard_fragments():
            r = frag.param_range
            item = {"param": frag.param, "start": r.start, "end": r.end}
            item.update({n: t.detach().cpu().clone() for n, t in frag.tensors.items()})
            payload.append(item)
            fragments.append([frag.param, r.start, r.end])
        # every rank's groups must be storable (a value only one rank holds fails there)
        meta.encode_metadata(optimizer.export_param_groups(), path / fmt.METADATA)
        if ranks.writes:
            written.append(_pending(path / name))
            entry = fmt.save_tensors(written[-1], {"fragments": payload})
    except Exception as e:
        error = e
    if os.environ.get(_KILL_ENV) == str(ranks.rank):
        os.kill(os.getpid(), signal.SIGKILL)
    gathered = ranks.gather((name, entry, fragments))
    if ranks.publishes and error is None:
        try:
            files = {n: e for n, e, _ in gathered}
            if model is not None:
                written.append(_pending(path / fmt.MODEL))
                files[fmt.MODEL] = fmt.save_tensors(written[-1], model.state_dict())
            text = meta.encode_signed(
                _metadata(optimizer, model, ranks.world, files, gathered), path / fmt.METADATA
            )
        except Exception as e:
            error = e
    try:
        ranks.agree(error, f"save to {path}")
    except CheckpointError:
        _remove(*written)
        raise

    # publish: unpublish the old checkpoint, move the new files into place, write metadata last;
    # a failure removes this save's files everywhere
    placed = [path / p.name[1 : -len(".pending")] for p in written]
    error = None
    try:
        if ranks.publishes:
            _remove(path / fmt.METADATA)
        ranks.agree(None, f"save to {path}")
        for pending, final in zip(written, placed):
            os.replace(pending, final)
    except CheckpointError:
        _remove(*written)
        raise
    except Exception as e:
        error = e
    try:
        ranks.agree(error, f"save to {path}")
        error = None
        if ranks.publishes:
            try:
                meta.write_metadata_text(path, text)
            except Exception as e:
                error = e
        ranks.agree(error, f"save to {path}")
    except CheckpointError:
        _remove(*written, *placed)
        raise
    if ranks.publishes:
        _remove_leftovers(path, set(files), replaced)


# what a save leaves behind only when it was killed (a pending file, a temporary of
# format.atomic_write) or when a later save replaced its checkpoint (rank files of another world
# size); never a user's file
_RANK_FILE = r"rank\d{5}-of-\d{5}\.pt"
_LEFTOVER = re.compile(
    rf"\.{{1,2}}({_RANK_FILE}|model\.pt|metadata\.json)(\.pending)?(\.tmp-\d+)?|{_RANK_FILE}"
)


def _listed_files(path: Path) -> set[str]:
    """The files the checkpoint in ``path`` lists (none if there is none or it is unreadable)."""
    try:
        files = json.loads((path / fmt.METADATA).read_bytes())["files"]
        return {n for n in files if isinstance(n, str) and Path(n).name == n}
    except (OSError, ValueError, TypeError, KeyError):
        return set()


def _remove_leftovers(path: Path, listed: set[str], replaced: set[str]) -> None:
    """Removes what killed or replaced saves left in ``path`` (pending and temporary files, rank
    files, the files the replaced checkpoint listed) but ``listed``, once the new checkpoint is
    complete: nothing a valid checkpoint needs is ever removed."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            name = entry.name
            if name in listed or not entry.is_file(follow_symlinks=False):
                continue
            if _LEFTOVER.fullmatch(name) or name in replaced:
                _remove(path / name)


def _metadata(optimizer, model, world: int, files: dict, gathered: list) -> dict[str, Any]:
    names = _param_names(optimizer, model)
    return {
        "format": meta.FORMAT,
        "version": meta.VERSION,
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
        "param_groups": optimizer.export_param_groups(),
        "fragments": {n: frags for n, _, frags in gathered},
        "files": files,
        "has_model": model is not None,
    }


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

    Each rank verifies and reads only the files whose fragments overlap what it owns now, and
    checks the model's state dict against ``model.pt``. Nothing (model included) is changed
    unless every rank found everything it needs intact: any error on any rank makes every rank
    raise first. The masters are taken from the checkpoint and written into the params, in every
    storage format (fp32, fp32 copy masters, ``store_param_remainders``, 16-bit state): without
    ``model`` the params still end with the saved weights.

    Args:
        path: a checkpoint directory written by ``save``.
        optimizer: a DistributedFused* optimizer of the same class over the same params.
        model: optional; loaded from ``model.pt`` when the checkpoint has one.

    Raises:
        CheckpointError: on every rank: incomplete directory, newer format, malformed metadata,
            another model, a missing, truncated or corrupted file (the message names the rank,
            the file and the problem).
    """
    _check_optimizer(optimizer)
    path = Path(path)
    ranks = _Ranks(optimizer, "shardopt.checkpoint.load()")
    error, metadata, payloads, model_state = None, None, [], None
    try:
        metadata = meta.read_metadata(path)
        check_compatible(metadata, optimizer, path)
        check_loaded_groups(metadata["param_groups"], optimizer.param_groups, str(path))
        # per group: DistributedFusedMuon's AdamW groups hold none of its Muon defaults
        expected = [
            {k: v for k, v in optimizer.defaults.items() if k in group}
            for group in optimizer.param_groups
        ]
        _check_hyperparameters(metadata["param_groups"], expected, path)
        mine: dict[int, list[Range]] = {}
        for frag in optimizer.shard_fragments():
            mine.setdefault(frag.param, []).append(frag.param_range)
        for name, frags in metadata["fragments"].items():
            if any(Range(s, e).intersect(r) for i, s, e in frags for r in mine.get(i, [])):
                payload = fmt.load_file(fmt.verify_file(path, name, metadata))
                fmt.check_payload(path / name, payload, frags)
                payloads.append(payload)
        _check_coverage(path, metadata, payloads, optimizer)
        if model is not None and metadata["has_model"]:
            model_state = fmt.load_file(fmt.verify_file(path, fmt.MODEL, metadata))
            _check_model_state(model, model_state, path)
    except Exception as e:
        error = e
    ranks.agree(error, f"load from {path}")

    # what is changed below, kept until every rank applied the checkpoint (transient: one copy
    # of this rank's shard and of the model), so a failure anywhere restores every rank
    backup = [{n: v.clone() for n, v in f.tensors.items()} for f in optimizer.shard_fragments()]
    groups_backup = optimizer.export_param_groups()
    model_backup = None
    if model_state is not None:
        model_backup = {k: v.clone() for k, v in model.state_dict().items()}
    error = None
    try:
        if model_state is not None:
            model.load_state_dict(model_state)
        with torch.no_grad():
            for frag in optimizer.shard_fragments(writable=True):
                for payload in payloads:
                    for saved in payload["fragments"]:
                        if saved["param"] != frag.param:
                            continue
                        piece = Range(saved["start"], saved["end"]).intersect(frag.param_range)
                        if piece is None:
                            continue
                        dst = piece.shift(-frag.param_range.start)
                        src = piece.shift(-saved["start"])
                        for n, view in frag.tensors.items():
                            view[dst.start : dst.end].copy_(saved[n][src.start : src.end])
        optimizer.import_param_groups(metadata["param_groups"])
    except Exception as e:
        error = e
    try:
        ranks.agree(error, f"load from {path}")
    except CheckpointError:
        with torch.no_grad():
            for frag, saved in zip(optimizer.shard_fragments(writable=True), backup):
                for n, view in frag.tensors.items():
                    view.copy_(saved[n])
        optimizer.drop_staged()  # compact storage: the uncommitted copies are not the state
        # the class's method: the instance's may be what failed (a wrapper, a patch)
        type(optimizer).import_param_groups(optimizer, groups_backup)
        if model_backup is not None:
            model.load_state_dict(model_backup)
        raise
    optimizer.publish_masters(restore_weights=True)


def _check_coverage(path: Path, metadata: dict, payloads: list, optimizer) -> None:
    """Every element of every state this rank restores is in a fragment that was read; else
    CheckpointError naming the state, the param and the first gap (a load never restores part
    of the state and keeps the rest)."""
    have: dict[tuple[int, str], list[Range]] = {}
    for payload in payloads:
        for f in payload["fragments"]:
            for n, t in f.items():
                if torch.is_tensor(t):
                    have.setdefault((f["param"], n), []).append(Range(f["start"], f["end"]))
    for frag in optimizer.shard_fragments():
        for n in frag.tensors:
            gap = fmt.first_gap(frag.param_range, have.get((frag.param, n), []))
            if gap is not None:
                name = metadata["params"][frag.param]["name"]
                raise CheckpointError(
                    f"{path}: state '{n}' of param {frag.param} '{name}': elements "
                    f"[{gap.start}, {gap.end}) are in no fragment of the checkpoint (the "
                    f"fragment lists of {fmt.METADATA} do not cover the param)"
                )


def _check_hyperparameters(groups: list, defaults: list[dict], path: Path) -> None:
    """Every saved group holds each hyperparameter of the optimizer's group (``defaults[i]``:
    the optimizer's defaults that group has), of the default's kind."""
    for i, (group, group_defaults) in enumerate(zip(groups, defaults)):
        for name, default in group_defaults.items():
            value = group.get(name)
            if name not in group:
                raise CheckpointError(f"{path}: param group {i} has no '{name}'")
            numeric = isinstance(default, (int, float)) or torch.is_tensor(default)
            if numeric and (
                isinstance(value, bool) != isinstance(default, bool)
                or not (isinstance(value, (int, float)) or torch.is_tensor(value))
            ):
                raise CheckpointError(
                    f"{path}: param group {i}: '{name}' must be like {default!r}, got {value!r}"
                )


def _check_model_state(model: torch.nn.Module, saved: dict[str, Any], path: Path) -> None:
    """The saved model state must fit the model exactly (keys, shapes, dtypes)."""
    mine = model.state_dict()
    problems = [f"missing key '{k}'" for k in mine if k not in saved]
    problems += [f"unexpected key '{k}'" for k in saved if k not in mine]
    for k, v in mine.items():
        s = saved.get(k)
        if torch.is_tensor(v) and torch.is_tensor(s) and (s.shape != v.shape):
            problems.append(f"'{k}': checkpoint {tuple(s.shape)}, model {tuple(v.shape)}")
    if problems:
        raise CheckpointError(
            f"{path / fmt.MODEL}: does not fit the model: " + "; ".join(problems[:10])
        )
