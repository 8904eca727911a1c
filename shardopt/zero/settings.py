"""The constructor settings of a DistributedFused* optimizer that need no process group: the
sync dtypes, the bucket size and where ``store_param_remainders`` applies (the engine raises what
they find on every rank)."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import torch

from shardopt.zero.layout import ElementLayout, ShardLayout

#: the keyword-only sharding arguments every DistributedFused* class takes
ZERO_ARGS_DOC = """
    Sharding arguments (keyword-only):
        process_group: the group the state is sharded over (default: WORLD).
        redundant_process_group: shards are replicated across this group (HSDP-style): grad
            shards are all-reduced over it after the reduce-scatter.
        bucket_cap_mb: bucket size in MiB (2**20 bytes) of grad-sync dtype (a positive finite
            number; default 100). Passed explicitly, construction warns, as Apex does, when the
            params fill less than 70% of the buckets as Apex counts them, naming a cap that
            fills them.
        dtype: optimizer state dtype: float32, or bfloat16/float16 (16-bit moments; params of
            that dtype are then their own masters, Apex's meaning).
        state_format: how the moments are stored (DistributedFusedAdam): "fp32", "bf16",
            "fp16", "scaled_fp16" (fp16 codes, an fp32 scale per 256-element block) or "int8"
            (8-bit codes into a dynamic quantisation map, a scale per block); default from
            ``dtype`` and ``with_scaled_states``. See Note: compact storage.
        store_param_remainders: (Apex) bf16 params keep an int16 remainder instead of an fp32
            master: the exact fp32 master is the param's bits plus the remainder; params are
            rounded half away from zero (DistributedFusedAdam); ValueError where it would change
            nothing (no bf16 param gathered in bf16, or fp16 params).
        with_scaled_states: (Apex) ``state_format="scaled_fp16"`` (DistributedFusedAdam).
        grad_sync_dtype: dtype grads are accumulated and reduce-scattered in (default: the param
            dtype for fp32 params, float32 for fp16/bf16/fp64 params; fp64 params keep fp32
            masters and state, as Apex's with dtype=float32).
        param_sync_dtype: dtype params are all-gathered in (default: the param dtype); an
            integer dtype of any width carries the bits of each param's value (Apex's bit
            copy; see Note: integer sync in shardopt/zero/sync_bits.py).
        average_grad_sync: average (True) or sum grads over ranks.
        overlap_grad_sync: start a bucket's reduce-scatter during backward once its grads are in.
        overlap_param_sync: leave the param all-gathers in flight after step() and wait for them
            just before the next module forward.
        skip_unused_params: skip params no rank computed a grad for, as torch.optim under
            DDP(find_unused_parameters=True) does (one small all-reduce and a host sync per
            step, which also checks that the ranks are in lockstep: see Note: lockstep); False
            updates them with a zero grad (no sync, no lockstep check). Off under ``capturable``.
        capturable: the step may be captured in a CUDA graph (with the forward and backward):
            no host sync, every collective joined before step() returns, lr may be a device
            tensor; needs overlap_param_sync=False and no GradScaler.
        offload: "cpu" or a ``shardopt.CPUOffload``: masters and state of (a fraction of) this
            rank's shard live in host memory, updated there by the same kernels (docs/offload.md).
        shard_layout: how each key's params are placed in buckets and rank shards
            (``shardopt.zero.layout``): ``ElementLayout()`` (the default: every bucket split
            evenly, a param may straddle ranks) or ``WholeParamLayout(cost=...)`` (each param
            whole on one rank, ranks balanced by cost, padded where it must be). Results and
            checkpoints do not depend on it; a subclass may choose per group by overriding
            ``shard_layout(group)`` (see Note: buckets and shards in docs/design.md).
        distributed_process_group, device, pipeline_size, contiguous_param_buffer,
            contiguous_grad_buffer, store_params, nccl_ub: Apex's keywords, with Apex's
            defaults and meanings (docs/migration.md, "From Apex").
        foreach, fused: accepted for torch.optim compatibility; no effect.
        maximize, differentiable: must be False (True raises NotImplementedError).

    Hyperparameters are checked as by the single-process classes (``check_hyperparams``).
    ``add_param_group`` after construction raises NotImplementedError: the flat buffers and shards
    are planned from the param groups at construction.
"""


class _DefaultCap(float):
    """``bucket_cap_mb``'s default, told apart from the same number passed by the user: the
    under-filled bucket warning (apex_compat.warn_underfilled) is advice about a chosen cap."""


DEFAULT_BUCKET_CAP_MB = _DefaultCap(100.0)


def cap_chosen(bucket_cap_mb: float) -> bool:
    """Whether ``bucket_cap_mb`` was passed rather than left at its default."""
    return not isinstance(bucket_cap_mb, _DefaultCap)


FLOAT_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Apex's bit-copy path, any width (see Note: integer sync in shardopt/zero/sync_bits.py)
INTEGER_SYNC_DTYPES = tuple(
    d
    for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))
)


def check_settings(
    name: str,
    grad_sync_dtype: torch.dtype | None,
    param_sync_dtype: torch.dtype | None,
    capturable: bool,
    overlap_param_sync: bool,
    bucket_cap_mb: float,
) -> None:
    """The sync dtypes and settings of one optimizer (or of params given their own dtypes)."""
    if grad_sync_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: grad_sync_dtype must be a floating dtype, got {grad_sync_dtype}")
    if param_sync_dtype not in FLOAT_DTYPES + INTEGER_SYNC_DTYPES:
        raise TypeError(
            f"{name}: param_sync_dtype must be a floating dtype or an integer dtype (Apex's "
            f"bit copy of the params' values), got {param_sync_dtype}"
        )
    if param_sync_dtype in INTEGER_SYNC_DTYPES and capturable:
        raise ValueError(f"{name}: an integer param_sync_dtype is not supported with capturable")
    if capturable and overlap_param_sync:
        raise ValueError(
            f"{name}: capturable=True needs the param all-gathers to finish inside step() "
            "(a CUDA graph must join all its work); use overlap_param_sync=False"
        )
    if not isinstance(bucket_cap_mb, numbers.Real) or isinstance(bucket_cap_mb, bool):
        raise TypeError(f"{name}: bucket_cap_mb must be a number of MB, got {bucket_cap_mb!r}")
    if not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
        raise ValueError(
            f"{name}: bucket_cap_mb must be a positive finite number of MB, got {bucket_cap_mb}"
        )


def resolve_layout(name: str, shard_layout: ShardLayout | None) -> ShardLayout:
    """The constructor's ``shard_layout``: ``ElementLayout()`` when None; TypeError for an object
    that is no ``ShardLayout`` (a ``plan`` method and a ``name``)."""
    if shard_layout is None:
        return ElementLayout()
    if not isinstance(shard_layout, ShardLayout):
        raise TypeError(
            f"{name}: shard_layout must be a ShardLayout (shardopt.zero.layout.ElementLayout() or "
            f"WholeParamLayout(...)), got {type(shard_layout).__name__}"
        )
    return shard_layout


def check_plain_params(name: str, param_groups: list[dict]) -> None:
    """DTensor params (FSDP2's ``fully_shard``, tensor parallelism) are refused naming the way
    out, instead of torch's error from the first collective on them."""
    from torch.distributed.tensor import DTensor

    index = 0
    for group in param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor):
                raise TypeError(
                    f"{name}: param {index} is a DTensor (placements {tuple(p.placements)}: "
                    "sharded by FSDP2's fully_shard or by tensor parallelism); a DistributedFused* "
                    "optimizer shards the optimizer state itself, over plain params: remove "
                    "fully_shard (the model stays a plain nn.Module), or keep FSDP2 and use the "
                    "single-process shardopt.FusedAdam (it takes DTensor params)"
                )
            index += 1


def check_remainders(name: str, param_groups: list[dict], param_sync_dtype) -> None:
    """``store_param_remainders=True`` only means something for bf16 params gathered in bf16
    (an fp32 param is its own master, an fp16 one has no bf16 top half): refused where it would
    be ignored, rather than silently keeping fp32 masters."""
    dtypes = {p.dtype for g in param_groups for p in g["params"] if p.requires_grad}
    if torch.float16 in dtypes:
        raise ValueError(
            f"{name}: store_param_remainders=True keeps an int16 remainder under a bf16 param; "
            "fp16 params have no such split (use it with bf16 params, or leave it off)"
        )
    if torch.bfloat16 not in dtypes or param_sync_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"{name}: store_param_remainders=True applies to bf16 params gathered in bf16, but "
            f"the trainable params are {sorted(str(d) for d in dtypes)} with param_sync_dtype="
            f"{param_sync_dtype}: it would change nothing; leave it off"
        )


#: torch.optim's common flags every class accepts (``check_torch_flags``), with their defaults
_TORCH_FLAG_DEFAULTS = {"foreach": None, "fused": None, "maximize": False, "differentiable": False}


def show_sharding_args(cls: type, engine_init, apex_defaults: dict[str, Any]) -> None:
    """``help(cls)`` and ``inspect.signature(cls)`` show every argument the class takes: its
    algorithm's (its own ``__init__``), then the engine's keyword-only sharding arguments, Apex's
    keywords and torch.optim's flags with their defaults (all of which the class receives through
    ``**zero_args``); the docstring gains ``ZERO_ARGS_DOC``."""
    own = inspect.signature(cls.__init__)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    kw = inspect.Parameter.KEYWORD_ONLY
    sharding = [p for p in inspect.signature(engine_init).parameters.values() if p.kind is kw]
    extra = {**apex_defaults, **_TORCH_FLAG_DEFAULTS}
    sharding += [inspect.Parameter(name, kw, default=value) for name, value in extra.items()]
    cls.__init__.__signature__ = own.replace(parameters=kept + sharding)
    cls.__doc__ = (cls.__doc__ or "") + ZERO_ARGS_DOC


def describe_hyperparams(
    groups: list[dict[str, Any]], skip: frozenset[str] = frozenset()
) -> list[dict[str, str]]:
    """Each group's hyperparameters as comparable strings (a 1-element tensor by its value;
    values that have no meaning on another rank, such as a multi-element tensor or an object,
    are left out), for the checks that every rank holds the same ones."""

    def text(v: Any) -> str | None:
        if torch.is_tensor(v):
            return repr(float(v.item())) if v.numel() == 1 and not v.is_meta else None
        if isinstance(v, (tuple, list)):
            parts = [text(x) for x in v]
            return None if None in parts else "(" + ", ".join(parts) + ")"  # type: ignore[arg-type]
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(float(v)) if isinstance(v, int) and not isinstance(v, bool) else repr(v)
        return None

    out = []
    for g in groups:
        desc = {k: text(v) for k, v in g.items() if k != "params" and k not in skip}
        out.append({k: v for k, v in desc.items() if v is not None})
    return out


def hyperparam_diffs(
    mine: list[dict[str, str]], everyone: list[list[dict[str, str]]], rank: int
) -> list[str]:
    """What differs between this rank's ``describe_hyperparams`` and every other rank's."""
    diffs = []
    for r, other in enumerate(everyone):
        for gi, (a, b) in enumerate(zip(mine, other)):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    diffs.append(
                        f"group {gi} {k}: rank {rank} has {a.get(k, 'nothing')}, rank {r} has "
                        f"{b.get(k, 'nothing')}"
                    )
    return diffs


def raise_if_hyperparams_differ(
    owner: str, what: str, mine: list[dict[str, str]], everyone: list, rank: int
) -> None:
    """ValueError on every rank (each compares itself with all) when hyperparameters differ."""
    diffs = hyperparam_diffs(mine, everyone, rank)
    if diffs:
        raise ValueError(
            f"{owner}: {what} differ between ranks (every rank must use the same lr, betas, "
            "weight_decay, ...; each would update its shard with its own): " + "; ".join(diffs[:5])
        )
