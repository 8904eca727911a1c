"""How a rank stores its masters and optimizer state, and the fp32 values state I/O sees.

Note: compact storage
    The update math always runs in fp32; what a rank keeps between steps can be smaller
    (``shardopt.state_codec`` defines every format bit for bit). Per key:

    - the master, one of three kinds:
        ``param``: the params are their own masters: fp32 params gathered in fp32, or 16-bit
            params when the state dtype is theirs (Apex's ``dtype=torch.bfloat16``);
        ``copy``: an fp32 master shard beside the low-precision params;
        ``remainder``: bf16 params with ``store_param_remainders=True``: the master is this
            rank's chunk of the bf16 params plus an int16 remainder per element, joined and split
            exactly (``join_master``/``split_master``); params round half away from zero;
    - the optimizer state, in one ``state_format``: ``fp32``, ``bf16``/``fp16`` (plain casts),
      ``scaled_fp16`` (fp16 codes and one fp32 scale per block) or ``int8`` (8-bit codes into a
      dynamic quantisation map and one fp32 scale per block); the unsigned state (Adam's
      ``exp_avg_sq``) as its root in fp16, scaled_fp16 and int8, and never a zero code where it
      is positive (``state_codec.ROOT_FORMATS``). Blocks are ``BLOCK`` elements of a
      shard; every param start and every chunk start is block-aligned (``align_numel``), so a
      block never holds two params and every kernel call and fragment starts on a block.

    Persistent bytes per param (P param bytes, N ranks, S state tensors of ``bytes_per_element``
    each): P + (M + S x state bytes) / N, with M = 0 (``param``), 4 (``copy``) or 2
    (``remainder``); alignment padding aside. ``memory_bytes()`` reports the exact figures.

    State I/O reads and writes fp32 values whatever the storage: ``read``/``write`` decode and
    encode one shard range, so saved state carries no encoding (state of any
    ``state_codec.VERSION`` loads into any format). A master written through state I/O into a
    ``remainder`` key is kept where it rounds to the param (see Note: the params are the truth
    in engine.py), so a load never moves a param.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardopt import state_codec
from shardopt.zero.layout import Range

MASTER = "master_param"
LOW_PRECISION_STATE = (torch.bfloat16, torch.float16)
_DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Storage:
    """The storage settings of one optimizer (the same on every rank)."""

    state_format: str = "fp32"
    remainders: bool = False
    state_dtype: torch.dtype = torch.float32

    @property
    def blockwise(self) -> bool:
        return state_codec.has_scales(self.state_format)

    def master_kind(self, param_dtype: torch.dtype, sync_dtype: torch.dtype) -> str:
        """``param``, ``copy`` or ``remainder`` for a key of ``param_dtype`` gathered in
        ``sync_dtype``."""
        if sync_dtype != param_dtype:
            return "copy"
        if param_dtype == torch.float32 or param_dtype == self.state_dtype:
            return "param"
        if self.remainders and param_dtype == torch.bfloat16:
            return "remainder"
        return "copy"

    def align_numel(self, align_numel: int) -> int:
        """Param and chunk alignment in elements: blockwise formats align to whole blocks."""
        if not self.blockwise:
            return align_numel
        return max(align_numel, state_codec.BLOCK) // state_codec.BLOCK * state_codec.BLOCK


def resolve(
    owner: str,
    *,
    dtype: torch.dtype,
    store_param_remainders: bool,
    with_scaled_states: bool,
    state_format: str | None,
    supported: bool,
) -> Storage:
    """The storage from Apex's keywords (``dtype``, ``store_param_remainders``,
    ``with_scaled_states``) and shardopt's ``state_format``; raises naming the conflict."""
    if dtype not in (torch.float32,) + LOW_PRECISION_STATE:
        raise TypeError(
            f"{owner}: dtype (optimizer state dtype) must be torch.float32, torch.bfloat16 or "
            f"torch.float16, got {dtype}"
        )
    implied = "scaled_fp16" if with_scaled_states else _DTYPE_FORMATS[dtype]
    if state_format is None:
        state_format = implied
    elif state_format not in state_codec.FORMATS:
        raise ValueError(
            f"{owner}: state_format must be one of {', '.join(state_codec.FORMATS)}, got "
            f"{state_format!r}"
        )
    elif state_format != implied and (with_scaled_states or dtype != torch.float32):
        raise ValueError(
            f"{owner}: state_format={state_format!r} conflicts with "
            + ("with_scaled_states=True" if with_scaled_states else f"dtype={dtype}")
        )
    if store_param_remainders and dtype != torch.float32:
        raise ValueError(
            f"{owner}: store_param_remainders=True rebuilds an fp32 master from the bf16 param; "
            f"it needs dtype=torch.float32, got {dtype}"
        )
    storage = Storage(state_format, bool(store_param_remainders), dtype)
    if not supported and (storage.remainders or state_format != "fp32"):
        what = "store_param_remainders=True" if storage.remainders else f"{state_format} state"
        raise NotImplementedError(
            f"{owner}: {what} is implemented for DistributedFusedAdam only; this optimizer keeps "
            "fp32 masters and fp32 state"
        )
    return storage


def blocks(r: Range) -> Range:
    """The scale entries of shard range ``r`` (which starts on a block)."""
    if r.start % state_codec.BLOCK:
        raise RuntimeError(f"shard range {r} does not start on a {state_codec.BLOCK}-element block")
    return Range(r.start // state_codec.BLOCK, state_codec.num_blocks(r.end))


def needs_codec(buffers) -> bool:
    """Whether state I/O must decode this key's shards (else it gets plain fp32 views)."""
    return (
        buffers.storage.state_format != "fp32"
        or buffers.master_kind == "remainder"
        or (buffers.master_kind == "param" and buffers.param_space.dtype != torch.float32)
    )


def read(buffers, name: str, r: Range) -> torch.Tensor:
    """The fp32 values of shard range ``r`` of state ``name`` (or ``MASTER``): decoded into a new
    tensor, or the master's own view for an fp32 ``copy`` master."""
    buf, fmt = buffers, buffers.storage.state_format
    if name == MASTER:
        master = buf.shard_slice(buf.master, r)
        if buf.master_kind == "remainder":  # (offloaded: bf16 half on the device, rest on host)
            remainder = buf.shard_slice(buf.remainder, r)
            return state_codec.join_master(master.to(remainder.device), remainder)
        return master.float()  # a copy for 16-bit own masters, the values for fp32
    codes = buf.shard_slice(buf.state[name], r)
    scales = None
    if buf.storage.blockwise:
        s = blocks(r)
        scales = buf.scales[name].narrow(0, s.start, s.numel)
    return state_codec.decode(codes, scales, fmt, signed=buf.state_signed[name])


@torch.no_grad()
def write(
    buffers, name: str, r: Range, values: torch.Tensor, *, restore_weights: bool = False
) -> None:
    """Stores fp32 ``values`` into shard range ``r`` of state ``name`` (or ``MASTER``).

    A master of a ``remainder`` or 16-bit ``param`` key is kept only where it rounds to the
    param, unless ``restore_weights`` (a checkpoint's masters are the weights to restore)."""
    buf, fmt = buffers, buffers.storage.state_format
    values = values.to(torch.float32).reshape(-1)
    if name == MASTER:
        master = buf.shard_slice(buf.master, r)
        if buf.master_kind == "remainder":
            values = values.to(buf.remainder.device)
            master = master.to(buf.remainder.device)  # a copy when offloaded, written back below
            if not restore_weights:
                rounded, remainder = state_codec.split_master(values)
                keep = rounded == master  # the params are the truth
                values = torch.where(keep, values, master.float())
            rounded, remainder = state_codec.split_master(values)
            buf.shard_slice(buf.master, r).copy_(rounded)
            buf.shard_slice(buf.remainder, r).copy_(remainder)
        elif buf.master_kind == "copy" or master.dtype == torch.float32 or restore_weights:
            master.copy_(values)
        # a 16-bit param that is its own master keeps its value: the params are the truth
        return
    codes, scales = state_codec.encode(values, fmt, signed=buf.state_signed[name])
    buf.shard_slice(buf.state[name], r).copy_(codes)
    if scales is not None:
        s = blocks(r)
        buf.scales[name].narrow(0, s.start, s.numel).copy_(scales)
