"""The constructor settings of a DistributedFused* optimizer that need no process group: the
sync dtypes, the bucket size and where ``store_param_remainders`` applies (the engine raises what
they find on every rank)."""

from __future__ import annotations

import math
import numbers

import torch

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
