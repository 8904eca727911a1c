"""Params gathered in an integer ``param_sync_dtype``: Apex's bit copy (see Note: integer sync).

Note: integer sync
Apex takes an integer ``param_sync_dtype`` of any width (its FP8-as-uint8 path, its scaled-state
configurations with bf16 params and int32 sync) and all-gathers raw bits in it. Here each sync
element carries the bits of the param's value, most significant first (little-endian), as many
bytes as both types hold:

- wider than the param (int32 or int64 sync for bf16 params, int64 for fp32 ones): the param's
  bits in the top bytes, the rest zero; the params receive exactly what gathering in their own
  dtype gives;
- as wide as the param: the same as gathering in the param dtype (the engine does that);
- narrower (uint8 for fp16 params: their e5m2 top byte; int16 for fp32 ones: bf16): the value
  rounded to nearest, ties to even, to what the top bytes hold (torch's own cast where torch has
  that format: ``float8_e5m2`` from an fp16 param, ``bfloat16`` from an fp32 one), the rest of
  the param zero.

The value is the master rounded to the param dtype first (the param's bytes, not the master's):
Apex copies the top bytes of its state-dtype master, which truncates instead of rounding and,
with fp32 masters of fp16 params, puts fp32 exponent bits into the fp16 layout. Non-finite values
keep their top bytes as they are (a NaN whose payload lies in the dropped bytes becomes inf).
"""

from __future__ import annotations

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: (param dtype, bytes kept) -> the torch float format those top bytes are
_TORCH_FORMAT = {(torch.float16, 1): torch.float8_e5m2, (torch.float32, 2): torch.bfloat16}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(numel, itemsize) uint8 view, little-endian: column -1 is the most significant byte."""
    return t.reshape(-1).view(torch.uint8).view(-1, t.element_size())


def param_bits(master: torch.Tensor, param_dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` most significant bytes of the masters' values in ``param_dtype``, rounded
    to nearest even where bytes are dropped: a (numel, nbytes) uint8 tensor."""
    value = master.reshape(-1).to(param_dtype)
    size = value.element_size()
    if nbytes >= size:
        return _as_bytes(value)
    fmt = _TORCH_FORMAT.get((param_dtype, nbytes))
    if fmt is not None:
        return _as_bytes(master.reshape(-1).to(fmt))
    bits = value.view(_BITS[size]).to(torch.int64)
    width = 8 * size
    sign = bits & (1 << (width - 1)) if width < 64 else bits & torch.iinfo(torch.int64).min
    magnitude = (
        bits & ((1 << (width - 1)) - 1) if width < 64 else bits & torch.iinfo(torch.int64).max
    )
    drop = 8 * (size - nbytes)
    lsb = (magnitude >> drop) & 1
    rounded = (magnitude + ((1 << (drop - 1)) - 1) + lsb) >> drop
    kept = torch.where(torch.isfinite(value), rounded, magnitude >> drop)
    top = (kept | (sign >> drop)) & ((1 << (8 * nbytes)) - 1)  # the sign lands on the top bit
    return _as_bytes(top)[:, :nbytes]


@torch.no_grad()
def write_sync(out: torch.Tensor, master: torch.Tensor, param_dtype: torch.dtype) -> None:
    """Stores masters into a sync-space view: a cast for a floating sync dtype, else the bits of
    the params' values (see Note: integer sync)."""
    if out.dtype.is_floating_point:
        out.copy_(master)
        return
    n = out.element_size()
    size = torch.empty((), dtype=param_dtype).element_size()
    dst = _as_bytes(out)
    if n > size:
        dst[:, : n - size].zero_()
        dst[:, n - size :].copy_(param_bits(master, param_dtype, size))
    else:
        dst.copy_(param_bits(master, param_dtype, n))


@torch.no_grad()
def sync_to_params(params: torch.Tensor, sync: torch.Tensor) -> None:
    """Gathered sync-space values into the params: a cast, or the carried bits into each param's
    most significant bytes (the rest zero)."""
    if sync.dtype.is_floating_point:
        params.copy_(sync)
        return
    n, size = sync.element_size(), params.element_size()
    dst, src = _as_bytes(params), _as_bytes(sync)
    if n >= size:
        dst.copy_(src[:, n - size :])
    else:
        dst[:, : size - n].zero_()
        dst[:, size - n :].copy_(src)
