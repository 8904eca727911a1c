"""``bmm_add``: ``beta * c + alpha * a @ b`` over a batch of matrices, as ``torch.baddbmm`` with
``c`` as its ``input``, into a new tensor, without the copy of ``c`` torch's CUDA baddbmm makes;
``symmetric_bmm_add``: the same for a product known to be symmetric, computing about half of it.

Out of place, torch's CUDA baddbmm copies ``input`` into its result, then runs the GEMM with
beta reading it back. On bf16/fp16 CUDA matrices this runs one cuBLASLt matmul that reads ``c``
and writes the result (csrc/linalg/bmm_add_cuda.cu, Note: why bmm_add): Newton-Schulz's two
products with an addend per step (``algorithms.muon``) skip a read and a write of every matrix.
The arithmetic is baddbmm's (fp32 accumulation, alpha and beta in fp32, one rounding), up to the
GEMM kernel cuBLAS picks. Everything else is ``torch.baddbmm``: CPU tensors, fp32 and fp64 (which
keep torch's TF32 settings), an extension built without CUDA, and while torch.compile traces
(Inductor sees the plain op).

Newton-Schulz's ``X Xᵀ`` and ``b A + c A²`` are symmetric. On the same 16-bit CUDA stacks,
``symmetric_bmm_add`` cuts the n x n result into bands of rows and computes only the lower block
triangle (each band's entries up to the end of its diagonal block, one cuBLASLt matmul per band,
written in place), then mirrors it: ``(bands + 1) / (2 bands)`` of the multiply-adds (Note:
symmetric products in csrc/linalg/bmm_add_cuda.cu). Each entry is the full product's dot
product, so the result is the full product's up to cuBLAS's kernel choice, exactly symmetric off
the diagonal blocks. Shorter bands are less efficient GEMMs: ``symmetric_bands`` keeps each band
at least ``SYMMETRIC_BAND_ROWS`` rows, so small matrices run the full product.

``set_matmul_tuning(n)`` (or ``SHARDOPT_MATMUL_TUNING=n`` in the environment) makes each new
cuBLASLt case of these products time cuBLASLt's first ``n`` heuristic algorithms at its first call
and keep the fastest (Note: tuning the matmuls in csrc/linalg/lt_matmul.cu). Off by default: the
algorithm, and with it the last bits of a product, then depends on timings, so two processes may
differ; and on an H100 it did not speed up Newton-Schulz (docs/benchmarks.md, 2026-12-07 23:48).
"""

from __future__ import annotations

import os
import re

import torch
from torch import Tensor

from shardopt.kernels import loader

_HALF = (torch.bfloat16, torch.float16)
#: the fewest rows of a band of ``symmetric_bmm_add`` (fewer bands below it; one: the full product)
SYMMETRIC_BAND_ROWS = 512
#: the most bands (more cut little work: 4 bands do 62.5% of the products, 8 do 56%, in shorter
#: GEMMs; on an H100, 4 bands beat 2 and 8 for n = 2048 and 4 beat 8 and 16 for n = 4096)
SYMMETRIC_MAX_BANDS = 4
#: the most heuristic algorithms ``set_matmul_tuning`` times per case (the extension's limit)
MAX_TUNING_CANDIDATES = 32
#: the setting where the extension has no CUDA kernels (it then changes nothing); None: not set
_tuning_without_cuda: int | None = None


def _fast(c: Tensor, *others: Tensor) -> bool:
    """Whether the cuBLASLt path takes these: 16-bit CUDA stacks of one dtype, not traced."""
    return (
        c.is_cuda
        and c.dtype in _HALF
        and all(t.dtype == c.dtype for t in others)
        and not torch.compiler.is_compiling()
        and loader.cuda_available()
    )


def bmm_add(a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """``beta * c + alpha * (a @ b)`` for 3-D ``a`` (k, p, q), ``b`` (k, q, r), ``c`` (k, p, r):
    ``torch.baddbmm(c, a, b, beta=beta, alpha=alpha)``, a new tensor; ``c`` is only read.

    ``a`` and ``b`` may be transposed views (``x.mT``) of contiguous stacks.

    Example:
        >>> a, b, c = torch.ones(1, 2, 3), torch.ones(1, 3, 2), torch.ones(1, 2, 2)
        >>> bmm_add(a, b, c, alpha=2.0, beta=0.5)[0, 0, 0].item()  # 0.5 * 1 + 2 * 3
        6.5
    """
    if _fast(c, a, b):
        return loader.extension().cuda.bmm_add(a, b, c, float(alpha), float(beta))
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def symmetric_bands(n: int) -> int:
    """How many bands ``symmetric_bmm_add`` cuts an n x n result into: as many as keep each at
    least ``SYMMETRIC_BAND_ROWS`` rows, at most ``SYMMETRIC_MAX_BANDS`` (1 below twice the rows:
    the full product)."""
    if SYMMETRIC_BAND_ROWS <= 0:
        return 1
    return max(1, min(SYMMETRIC_MAX_BANDS, n // SYMMETRIC_BAND_ROWS))


def _check_symmetric(a: Tensor, b: Tensor, c: Tensor | None) -> None:
    """The shapes ``symmetric_bmm_add`` takes, on every device, with the shapes named."""
    shapes = [tuple(a.shape), tuple(b.shape)] + ([] if c is None else [tuple(c.shape)])
    if a.dim() != 3 or b.dim() != 3 or (c is not None and c.dim() != 3):
        raise ValueError(f"symmetric_bmm_add: a, b and c must be 3-D, got shapes {shapes}")
    k, n, q = a.shape
    if tuple(b.shape) != (k, q, n):
        raise ValueError(
            f"symmetric_bmm_add: a {tuple(a.shape)} @ b {tuple(b.shape)} is not a batch of "
            f"square products (b must be ({k}, {q}, {n}))"
        )
    if c is not None and tuple(c.shape) != (k, n, n):
        raise ValueError(
            f"symmetric_bmm_add: c {tuple(c.shape)} must be the product's shape ({k}, {n}, {n})"
        )


def symmetric_bmm_add(
    a: Tensor, b: Tensor, c: Tensor | None = None, *, alpha: float = 1.0, beta: float = 1.0
) -> Tensor:
    """``beta * c + alpha * (a @ b)`` (``alpha * (a @ b)`` without ``c``) for a product the caller
    knows is symmetric: ``a`` (k, n, q), ``b`` (k, q, n), ``c`` (k, n, n) symmetric, as
    ``X Xᵀ`` or ``b A + c A²``; a new tensor, ``c`` only read.

    On 16-bit CUDA stacks only the lower block triangle is computed and then mirrored (the
    module's docstring); elsewhere it is ``torch.bmm`` / ``torch.baddbmm`` of the whole, bit for
    bit. ``a`` and ``b`` may be transposed views (``x.mT``) of contiguous stacks.

    Example:
        >>> x = torch.ones(1, 2, 3)
        >>> symmetric_bmm_add(x, x.mT, alpha=2.0)[0].tolist()
        [[6.0, 6.0], [6.0, 6.0]]
    """
    _check_symmetric(a, b, c)
    if _fast(a, b, *(() if c is None else (c,))):
        cuda, bands = loader.extension().cuda, symmetric_bands(a.size(-2))
        if c is None:
            return cuda.symmetric_bmm(a, b, float(alpha), bands)
        return cuda.symmetric_bmm_add(a, b, c, float(alpha), float(beta), bands)
    if c is None:
        out = torch.bmm(a, b)
        return out if alpha == 1.0 else out.mul_(alpha)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def set_matmul_tuning(candidates: int) -> None:
    """Time cuBLASLt's first ``candidates`` heuristic algorithms for each new case of
    ``bmm_add`` / ``symmetric_bmm_add`` on CUDA at its first call, and keep the fastest; 0 or 1:
    the heuristic's first, untimed (the default). Cases already met keep their algorithm.

    A tuned case's first call synchronizes the device and runs each candidate about a
    millisecond, into a scratch tensor the size of its result; later calls only launch. The
    bits of a tuned product are those of the algorithm timing chose: reproducible within a
    process, not across processes. A case first met during CUDA graph capture is not timed.

    Example:
        >>> set_matmul_tuning(8)
        >>> matmul_tuning()
        8
        >>> set_matmul_tuning(0)
    """
    global _tuning_without_cuda
    if isinstance(candidates, bool) or not isinstance(candidates, int):
        raise TypeError(f"set_matmul_tuning: candidates must be an int, got {candidates!r}")
    if not 0 <= candidates <= MAX_TUNING_CANDIDATES:
        raise ValueError(
            f"set_matmul_tuning: candidates must be in [0, {MAX_TUNING_CANDIDATES}], got "
            f"{candidates}"
        )
    if loader.cuda_available():
        loader.extension().cuda.set_matmul_tuning(candidates)
    else:
        _tuning_without_cuda = candidates


def matmul_tuning() -> int:
    """The ``set_matmul_tuning`` setting (at first ``SHARDOPT_MATMUL_TUNING``, else 0; a value
    there that is not an integer in ``[0, MAX_TUNING_CANDIDATES]`` raises, naming it)."""
    if loader.cuda_available():
        return int(loader.extension().cuda.matmul_tuning())
    if _tuning_without_cuda is not None:
        return _tuning_without_cuda
    return _tuning_from_environment()


def _tuning_from_environment() -> int:
    """``SHARDOPT_MATMUL_TUNING`` read as the extension reads it (strtoll of the whole value):
    unset or empty is 0; anything but an integer in range is an error that names it."""
    text = os.environ.get("SHARDOPT_MATMUL_TUNING", "")
    if not text:
        return 0
    match = re.fullmatch(r"\s*[+-]?[0-9]+", text)
    if match is None or not 0 <= int(text) <= MAX_TUNING_CANDIDATES:
        raise ValueError(
            f"SHARDOPT_MATMUL_TUNING must be an integer in [0, {MAX_TUNING_CANDIDATES}], got "
            f"{text!r}"
        )
    return int(text)


def matmul_tuning_stats() -> tuple[int, int]:
    """``(timed, changed)``: the cases tuned so far in this process, and how many of them kept
    another algorithm than the heuristic's first ((0, 0) without CUDA kernels)."""
    if not loader.cuda_available():
        return (0, 0)
    timed, changed = loader.extension().cuda.matmul_tuning_stats()
    return int(timed), int(changed)
