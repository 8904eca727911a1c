"""Compact formats of the Adam state of a flat shard: the codec's definition, in plain torch.

The distributed Adam can keep, per element of a rank's shard, its fp32 master as a bf16 param plus
a 16-bit remainder, and the moments ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``) in a compact
format. This module defines those formats bit for bit; the fused kernels
(``csrc/optim/state_codec.h``, used by ``shardopt.kernels.adam_compact``) produce the same bits, and
checkpoints decode and encode through it. Everything here is fp32 or integer arithmetic on whole
tensors (no Python loops over elements).

Note: compact state formats
- Master split: a fp32 master is stored as ``(param, remainder)``: a bf16 ``param`` (the upper 16
  bits, rounded half away from zero) and an int16 ``remainder`` with
  ``bits(master) = (bits(param) << 16) + remainder (mod 2^32)``, exact for every bit pattern
  (Apex's param remainders). Round-to-nearest-even cannot carry an exact 16-bit remainder: an even
  bf16 value has 65,537 fp32 preimages. A NaN master becomes a quiet NaN param with the NaN's sign
  and remainder 0, so a diverged master never shows as a finite param.
- Formats of ``m`` and ``v`` (``FORMATS``): ``"fp32"``; ``"bf16"`` and ``"fp16"`` (plain
  round-to-nearest-even casts); ``"scaled_fp16"`` (fp16 codes and one fp32 scale per block);
  ``"int8"`` (uint8 indices into the dynamic quantization map and one fp32 scale per block). A
  block is ``BLOCK`` consecutive elements from element 0 of each tensor; the last may be partial.
- amax is the largest ``|x|`` of a block, taken on the bits (``bits & 0x7FFFFFFF``, an integer
  max, so a NaN counts as larger than inf).
- scaled_fp16: a block whose amax is 0 or not finite has scale 1; otherwise ``s = 2^max(E - 15,
  -126)`` with ``amax = f * 2^E``, ``f`` in [0.5, 1) (frexp), so ``|x / s| < 2^15`` and both ``s``
  and ``1 / s`` are normal floats. ``code = fp16_rne(x * (1 / s))``, ``decode = float(code) * s``.
  Non-finite values stay non-finite, element by element.
- int8: a block whose amax is below 2^-126 (zero or subnormal) has scale 0 and every code the
  index of 0.0; a block holding a non-finite value has scale +inf (inf only) or NaN (any NaN),
  and every code the index of 0.0, so the whole block decodes to NaN (divergence stays visible).
  Otherwise ``scale = amax``, ``xn = x * (1.0f / amax)`` (fp32), and ``code`` is the number of
  ``j`` in [0, 255) with ``mid[j] < xn``, ``mid[j] = (map[j] + map[j + 1]) * 0.5f`` in fp32 (a tie
  goes to the lower code). ``decode = map[code] * scale``.
- Zeros encode to codes that decode to exact zeros in every format (block padding stays 0), except
  in an int8 block that holds a non-finite value.
- The second moment ``v`` (``signed=False``): fp16, scaled_fp16 and int8 (``ROOT_FORMATS``) keep
  its root ``r = sqrt(v)`` (correctly rounded) and decode ``v = r * r`` (fp32); r has the
  dynamic range of ``m`` (``|m| <= c * r`` in exact Adam: c = 7.3 at betas (0.9, 0.999)), where
  v's own range (fp16's; int8's and scaled_fp16's relative to the block amax) holds only half
  its decades: v underflowed where m did not and the update became ``m / eps``. A block's scale
  is that of its roots. In every compact format a positive stored value (``v`` in bf16, ``r``
  elsewhere) never encodes to a zero code: below the smallest positive code value (``2^-133`` in
  bf16, ``2^-24`` in fp16 and scaled_fp16 after the scale, ``map[1]`` of the unsigned int8 map
  after the scale) it takes that value; so a positive v never decodes to 0 (except where the
  fp32 square of its decoded root underflows, below 2^-149, where ``m / eps`` is negligible). A
  negative v (not an Adam state) has a NaN root: it decodes to NaN, as its fp32 update would.
  bf16 keeps ``v`` itself: its range is fp32's. ``VERSION`` 2; version 1 kept ``v`` in every
  format. Checkpoints and state dicts hold decoded fp32 values, so those of any version load
  into any format (re-encoded on load).

Example:
    >>> codes, scales = encode(torch.randn(1000), "int8", signed=True)
    >>> decode(codes, scales, "int8", signed=True).shape
    torch.Size([1000])
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "BLOCK",
    "FORMATS",
    "ROOT_FORMATS",
    "VERSION",
    "bytes_per_element",
    "code_dtype",
    "decode",
    "encode",
    "has_scales",
    "join_master",
    "num_blocks",
    "quantization_map",
    "split_master",
    "stores_root",
    "zero_code",
]

Tensor = torch.Tensor

BLOCK = 256
FORMATS = ("fp32", "bf16", "fp16", "scaled_fp16", "int8")
#: the formats that keep the second moment as its root (see Note: compact state formats)
ROOT_FORMATS = ("fp16", "scaled_fp16", "int8")
#: the version of the encoding: 2 keeps the root of v in ROOT_FORMATS (1 kept v)
VERSION = 2

_CODE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "scaled_fp16": torch.float16,
    "int8": torch.uint8,
}
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_MIN_NORMAL_BITS = 0x00800000  # 2^-126
# the smallest positive code value of a stored v (bf16) or root (fp16 and scaled_fp16 codes)
_TINY = {"bf16": 2.0**-133, "fp16": 2.0**-24, "scaled_fp16": 2.0**-24}


def _check_format(fmt: str) -> None:
    if fmt not in _CODE_DTYPES:
        raise ValueError(f"unknown state format {fmt!r}: expected one of {', '.join(FORMATS)}")


def code_dtype(fmt: str) -> torch.dtype:
    """The dtype of the codes of format ``fmt``."""
    _check_format(fmt)
    return _CODE_DTYPES[fmt]


def has_scales(fmt: str) -> bool:
    """Whether format ``fmt`` keeps one fp32 scale per block (the blockwise formats)."""
    _check_format(fmt)
    return fmt in ("scaled_fp16", "int8")


def num_blocks(numel: int) -> int:
    """Blocks (and so scales) of a tensor of ``numel`` elements: ceil(numel / BLOCK)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // BLOCK)


def bytes_per_element(fmt: str) -> float:
    """Bytes one element of format ``fmt`` takes, its block's scale amortised (int8: 1 + 4/256)."""
    size = torch.empty((), dtype=code_dtype(fmt)).element_size()
    return size + (4 / BLOCK if has_scales(fmt) else 0.0)


# -- the master: bf16 param + int16 remainder ----------------------------------------------------


def _check_dtype(t: Tensor, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{what} must be a {dtype} tensor, got {got}")


def _bits(x: Tensor) -> Tensor:
    """The fp32 bit patterns of ``x`` as non-negative int64 (u in [0, 2^32))."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(u: Tensor) -> Tensor:
    """fp32 tensor with bit patterns ``u`` (int64 in [0, 2^32))."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """Splits fp32 masters into a bf16 param and an int16 remainder (see Note: compact state
    formats): ``hi = (u + 0x8000) >> 16``, ``lo = int16(u & 0xFFFF)`` for the bits ``u``.

    Args:
        master: fp32 tensor of any shape.

    Returns:
        ``(param, remainder)``: bf16 and int16 tensors of the master's shape;
        ``join_master(param, remainder)`` gives back the master's exact bits.

    Raises:
        TypeError: ``master`` is not fp32.
    """
    _check_dtype(master, torch.float32, "split_master: master")
    u = _bits(master)
    hi = ((u + 0x8000) >> 16) & 0xFFFF
    lo = u & 0xFFFF
    lo = torch.where(lo >= 0x8000, lo - 0x10000, lo)
    nan = torch.isnan(master)
    hi = torch.where(nan, 0x7FC0 | ((u >> 31) << 15), hi)
    lo = torch.where(nan, 0, lo)
    param = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16)
    return param, lo.to(torch.int16)


def join_master(param: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master of a bf16 ``param`` and int16 ``remainder``: bits ``(hi << 16) + lo``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: the shapes differ.
    """
    _check_dtype(param, torch.bfloat16, "join_master: param")
    _check_dtype(remainder, torch.int16, "join_master: remainder")
    if param.shape != remainder.shape:
        raise ValueError(
            f"join_master: param shape {tuple(param.shape)} != remainder shape "
            f"{tuple(remainder.shape)}"
        )
    hi = param.view(torch.int16).to(torch.int64) & 0xFFFF
    return _from_bits(((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF)


# -- the dynamic quantization map ----------------------------------------------------------------


def _dynamic_map(signed: bool) -> Tensor:
    """The 256 sorted values of the map, in float64 (see quantization_map)."""
    positive = []
    for level in range(7):  # magnitudes 10^-6 .. 10^0, each a linear grid on [0.1, 1] x 10^level
        steps = 2**level if signed else 2 ** (level + 1)
        bounds = torch.linspace(0.1, 1.0, steps + 1, dtype=torch.float64)
        positive.append((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (level - 6))
    pos = torch.cat(positive)
    if signed:
        # 127 positive means, their negatives, 0, 1 and -1 are 257 values: the negative of the
        # smallest mean (-5.5e-7) makes way for -1, so a block's amax encodes exactly either sign.
        neg = -pos[1:]
        values = torch.cat([pos, neg, torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)])
    else:
        values = torch.cat([pos, torch.tensor([0.0, 1.0], dtype=torch.float64)])
    return values.sort().values


@functools.cache
def _cached_map(signed: bool, device: torch.device) -> Tensor:
    values = _dynamic_map(signed).to(torch.float32)
    if values.numel() != 256 or values.unique().numel() != 256:
        raise AssertionError("the dynamic map must have 256 distinct fp32 values")
    return values.to(device)


def quantization_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The dynamic (tree) quantization map of the int8 format: 256 sorted fp32 values.

    The construction of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR
    2022), as bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: for
    each magnitude 10^-6 .. 10^0, the midpoints of a linear grid of 2^k (signed) or 2^(k+1)
    (unsigned) steps over [0.1, 1] times that magnitude (k = 0 .. 6), plus 0 and 1. Computed in
    float64, cast to fp32. The unsigned map (for ``v``) spans [0, 1]. The signed map (for ``m``)
    holds the positive midpoints, 0, 1, -1 and the negative midpoints except the smallest one
    (bitsandbytes' signed map has no -1: it keeps -5.5e-7 instead), so it spans [-1, 1].

    Args:
        signed: the map of ``m`` (True) or of ``v`` (False).
        device: where the returned (cached, not to be modified) tensor lives.
    """
    return _cached_map(bool(signed), torch.device(device))


@functools.cache
def _cached_mids(signed: bool, device: torch.device) -> Tensor:
    values = _cached_map(signed, device)
    return (values[:-1] + values[1:]) * 0.5


def zero_code(signed: bool) -> int:
    """The int8 code of 0.0 (127 in the signed map, 0 in the unsigned one)."""
    return int((quantization_map(signed) == 0).nonzero().item())


# -- encode / decode -----------------------------------------------------------------------------


def _blocks(x: Tensor) -> Tensor:
    """``x`` zero-padded to whole blocks, as a (num_blocks, BLOCK) view."""
    pad = num_blocks(x.numel()) * BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def _check_flat(x: Tensor, what: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{what} must be a 1-D tensor, got {shape}")


def _amax_bits(blocks: Tensor) -> Tensor:
    """Per block, the bits of max |x| as int64 (an integer max: NaN > inf > finite)."""
    return (blocks.view(torch.int32) & _ABS_MASK).amax(dim=1).to(torch.int64)


def _root(v: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (torch's CPU fp32 sqrt is not; a double's sqrt
    rounded to fp32 is, as 53 >= 2 * 24 + 2)."""
    return torch.sqrt(v.double()).float()


def _floor_positive(q: Tensor, x: Tensor, tiny: float | Tensor) -> Tensor:
    """``x`` (q scaled) raised to ``tiny`` where the stored value ``q`` is positive: a positive v
    never gets a zero code."""
    return torch.where((q > 0) & (x < tiny), tiny, x)


def stores_root(fmt: str, signed: bool) -> bool:
    """Whether state of format ``fmt`` keeps its root: the second moment (``signed=False``) in
    ``ROOT_FORMATS``."""
    _check_format(fmt)
    return not signed and fmt in ROOT_FORMATS


def encode(x: Tensor, fmt: str, *, signed: bool) -> tuple[Tensor, Tensor | None]:
    """Encodes fp32 values in format ``fmt`` (see Note: compact state formats).

    Args:
        x: 1-D fp32 tensor (a flat shard of ``m`` or ``v``).
        fmt: one of ``FORMATS``.
        signed: True for ``m``; False for the second moment ``v`` (the unsigned int8 map, its
            root in ``ROOT_FORMATS``, never a zero code for a positive value).

    Returns:
        ``(codes, scales)``: codes of ``code_dtype(fmt)`` and ``x``'s length; scales a fp32 tensor
        of ``num_blocks(len(x))`` elements for the blockwise formats, else None.

    Raises:
        TypeError: ``x`` is not fp32. ValueError: unknown format or ``x`` not 1-D.
    """
    _check_format(fmt)
    _check_dtype(x, torch.float32, "encode: x")
    _check_flat(x, "encode: x")
    second = not signed and fmt != "fp32"
    if stores_root(fmt, signed):
        x = _root(x)
    if not has_scales(fmt):
        if second:
            x = _floor_positive(x, x, _TINY[fmt])
        return x.to(_CODE_DTYPES[fmt]), None
    n = x.numel()
    blocks = _blocks(x)
    amax = _amax_bits(blocks)
    if fmt == "scaled_fp16":
        exponent = torch.clamp((amax >> 23) - 14, min=1)  # biased exponent of 2^max(E - 15, -126)
        special = (amax == 0) | (amax >= _INF_BITS)
        scale_bits = torch.where(special, 127, exponent) << 23
        inv = _from_bits((254 << 23) - scale_bits)  # 1 / s exactly: biased exponent 254 - e
        scaled = blocks * inv[:, None]
        if second:
            scaled = _floor_positive(blocks, scaled, _TINY[fmt])
        codes = scaled.to(torch.float16)
        return codes.view(-1)[:n], _from_bits(scale_bits)
    mids = _cached_mids(bool(signed), x.device)
    scale = torch.where(amax < _MIN_NORMAL_BITS, 0, amax)
    scale = torch.where(amax > _INF_BITS, _NAN_BITS, scale)
    scale = _from_bits(scale)
    normal = (amax >= _MIN_NORMAL_BITS) & (amax < _INF_BITS)
    inv = torch.where(normal, 1.0 / torch.where(normal, scale, 1.0), 0.0)
    xn = blocks * inv[:, None]
    if second:
        xn = _floor_positive(blocks, xn, quantization_map(False, x.device)[1])
    codes = torch.searchsorted(mids, xn.contiguous())
    codes = torch.where(normal[:, None], codes, zero_code(signed))
    return codes.to(torch.uint8).view(-1)[:n], scale


def decode(codes: Tensor, scales: Tensor | None, fmt: str, *, signed: bool) -> Tensor:
    """Decodes ``codes`` (and the blocks' ``scales``) of format ``fmt`` to a 1-D fp32 tensor.

    Args:
        codes: 1-D tensor of ``code_dtype(fmt)``.
        scales: fp32 tensor of ``num_blocks(len(codes))`` elements (blockwise formats), else None.
        fmt: one of ``FORMATS``.
        signed: True for ``m``; False for the second moment ``v`` (squared from its root in
            ``ROOT_FORMATS``).

    Raises:
        TypeError: wrong dtypes. ValueError: unknown format, wrong shapes or a missing or
            unexpected ``scales``.
    """
    _check_format(fmt)
    _check_dtype(codes, _CODE_DTYPES[fmt], f"decode: {fmt} codes")
    _check_flat(codes, "decode: codes")
    if not has_scales(fmt):
        if scales is not None:
            raise ValueError(f"decode: format {fmt} has no scales, got a scales tensor")
        values = codes.to(torch.float32)
    else:
        if scales is None:
            raise ValueError(f"decode: format {fmt} needs its per-block scales")
        _check_dtype(scales, torch.float32, "decode: scales")
        n = codes.numel()
        if scales.numel() != num_blocks(n):
            raise ValueError(
                f"decode: {n} codes need {num_blocks(n)} scales (one per {BLOCK} elements), got "
                f"{scales.numel()}"
            )
        per_element = scales.reshape(-1).repeat_interleave(BLOCK)[:n]
        if fmt == "scaled_fp16":
            values = codes.to(torch.float32) * per_element
        else:
            values = quantization_map(signed, codes.device)[codes.to(torch.int64)] * per_element
    return values * values if stores_root(fmt, signed) else values
