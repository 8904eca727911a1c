"""The Newton-Schulz part of bench_muon.py and the bf16 GEMM ceiling it is compared with.

For one set's Muon matrices, stacked by shape in bf16 as FusedMuon stacks them: shardopt's batched
``newton_schulz`` (and Gram Newton-Schulz where shardopt has it), torch.optim.Muon's iteration
one matrix at a time, and the same products as plain ``torch.bmm`` into preallocated outputs
(the GEMM ceiling at these shapes). Rates count ``bench_muon_sets.ns_flops`` for every variant:
an iteration that skips work (Gram) is credited with the standard count, as the issue's target
says.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from bench_common import free_memory, median, time_fn
from bench_muon_sets import ns_flops

NS_STEPS = 5
EPS = 1e-7
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: the dtype of a variant's stacks where it is not bf16 (torch's)
VARIANT_DTYPES = {"shardopt_gram_fp16_batched": torch.float16}
#: ``symmetric_bmm_add``'s fewest band rows timed beside the default (0: whole products)
SWEPT_BAND_ROWS = (0, 1024, 256)
#: ``kernels.set_matmul_tuning`` settings timed beside the default (no tuning)
SWEPT_TUNING = (8, 32)


def _rate(flops: float, ms: float) -> float:
    return flops / ms / 1e9  # TFLOP/s


def _stacks(
    shapes: list[tuple[int, int, int]], device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """Random stacks (bf16 unless told), one per shape; never zeros (zeros run faster)."""
    return [torch.randn(c, r, k, device=device, dtype=dtype) for c, r, k in shapes]


def gemm_square(n: int, device: torch.device, timing: dict[str, Any]) -> dict[str, Any]:
    """The bf16 rate of one ``n``³ matmul into a preallocated output."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = median(time_fn(lambda: torch.mm(a, b, out=out), device, **timing))
    flops = 2.0 * n**3
    a = b = out = None
    free_memory(device)
    return {
        "kind": "gemm",
        "what": f"mm {n}^3",
        "ms": ms,
        "flops": flops,
        "tflops": _rate(flops, ms),
    }


def _gemm_chain(stacks: list[torch.Tensor]) -> Callable[[], None]:
    """The products of 5 Newton-Schulz steps as plain ``bmm`` with preallocated outputs (each
    stack taken wide, n <= m): ``X Xᵀ`` (n x n), ``A A`` (n x n), ``B X`` (n x m)."""
    work = []
    for x in stacks:
        if x.size(-2) > x.size(-1):
            x = x.mT.contiguous()
        k, n, _ = x.shape
        gram = torch.empty(k, n, n, device=x.device, dtype=x.dtype)
        square = torch.empty_like(gram)
        out = torch.empty_like(x)
        work.append((x, gram, square, out))

    def run() -> None:
        for _ in range(NS_STEPS):
            for x, gram, square, out in work:
                torch.bmm(x, x.mT, out=gram)
                torch.bmm(gram, gram, out=square)
                torch.bmm(square, x, out=out)

    return run


def _merged_orientations(
    stacks: list[torch.Tensor], run_all: Callable[[list[torch.Tensor]], list[torch.Tensor]]
) -> Callable[[], list[torch.Tensor]]:
    """A trial of one stack per wide shape: each tall stack transposed (copied) into one stack
    with the wide stacks of its shape (124M: 3072 x 768 beside 768 x 3072, 24 matrices in one
    chain), ``run_all`` on the merged stacks, then each tall part copied back into its layout;
    the copies are timed with the rest."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, x in enumerate(stacks):
        groups.setdefault((min(x.shape[-2:]), max(x.shape[-2:])), []).append(i)

    def run() -> list[torch.Tensor]:
        merged = []
        for members in groups.values():
            parts = [stacks[i].mT if stacks[i].size(-2) > stacks[i].size(-1) else stacks[i]
                     for i in members]  # fmt: skip
            merged.append(parts[0].contiguous() if len(parts) == 1 else torch.cat(parts))
        outs = run_all(merged)
        results: list = [None] * len(stacks)
        for members, out in zip(groups.values(), outs):
            start = 0
            for i in members:
                part = out[start : start + stacks[i].size(0)]
                start += stacks[i].size(0)
                tall = stacks[i].size(-2) > stacks[i].size(-1)
                results[i] = part.mT.contiguous() if tall else part
        return results

    return run


def _shardopt_ns(muon_alg: Any, name: str) -> Callable | None:
    """shardopt's Newton-Schulz function ``name`` if it exists and takes (x, coefficients, eps)."""
    fn = getattr(muon_alg, name, None)
    if fn is None:
        return None
    params = list(inspect.signature(fn).parameters)
    return fn if params[:3] == ["x", "coefficients", "eps"] else None


def _with_baddbmm(kernels: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``kernels.bmm_add`` and ``kernels.symmetric_bmm_add`` replaced by
    ``torch.baddbmm`` / ``torch.bmm`` of the whole product (the tree before either)."""

    def baddbmm(a, b, c=None, *, alpha=1.0, beta=1.0):
        if c is None:
            return torch.bmm(a, b).mul_(alpha) if alpha != 1.0 else torch.bmm(a, b)
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)

    names = [n for n in ("bmm_add", "symmetric_bmm_add") if hasattr(kernels, n)]

    def run() -> Any:
        saved = {n: getattr(kernels, n) for n in names}
        for n in names:
            setattr(kernels, n, baddbmm)
        try:
            return fn()
        finally:
            for n, f in saved.items():
                setattr(kernels, n, f)

    return run


def _with_band_rows(matmul: Any, rows: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``symmetric_bmm_add``'s fewest band rows set to ``rows`` (0: every
    symmetric product whole, the tree before it)."""

    def run() -> Any:
        saved = matmul.SYMMETRIC_BAND_ROWS
        matmul.SYMMETRIC_BAND_ROWS = rows
        try:
            return fn()
        finally:
            matmul.SYMMETRIC_BAND_ROWS = saved

    return run


def _with_tuning(kernels: Any, candidates: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with cuBLASLt's algorithms timed per case (``kernels.set_matmul_tuning``): the
    cases are new at this setting, so the warm-up calls time them and the timed calls launch."""

    def run() -> Any:
        saved = kernels.matmul_tuning()
        kernels.set_matmul_tuning(candidates)
        try:
            return fn()
        finally:
            kernels.set_matmul_tuning(saved)

    return run


def measure_ns(
    set_name: str,
    shapes: list[tuple[int, int, int]],
    device: torch.device,
    timing: dict[str, Any],
    muon_alg: Any,
    gemm_tflops: float | None,
) -> list[dict[str, Any]]:
    """Rows of the Newton-Schulz part of one set: each variant's ms and TFLOP/s, and its share
    of the 8192³ GEMM rate and of the same-shape GEMM rate (both measured in this run)."""
    flops = ns_flops(shapes, NS_STEPS)
    coefficients = [COEFFICIENTS] * NS_STEPS
    one_stream = (
        "shardopt_batched",
        lambda st: lambda: [muon_alg.newton_schulz(x, coefficients, EPS) for x in st],
    )
    variants: list[tuple[str, Callable[[list[torch.Tensor]], Callable[[], Any]]]] = [
        ("gemm_same_shapes", _gemm_chain)
    ]
    try:  # FusedMuon's own way through a group's stacks (small ones at once on side streams)
        streams = importlib.import_module("shardopt.algorithms.muon_streams")
    except ImportError:  # a tree before it: one stack after another
        variants.append(one_stream)
    else:
        variants.append(
            (
                "shardopt_batched",
                lambda st: (
                    lambda: list(
                        streams.orthogonalized(
                            st, lambda x: muon_alg.newton_schulz(x, coefficients, EPS)
                        )
                    )
                ),
            )
        )
        variants.append(("shardopt_batched_one_stream", one_stream[1]))
        # a trial: tall stacks merged, transposed, into the wide stacks of their shape
        variants.append(
            (
                "shardopt_batched_merged",
                lambda st: _merged_orientations(
                    st,
                    lambda merged: list(
                        streams.orthogonalized(
                            merged, lambda x: muon_alg.newton_schulz(x, coefficients, EPS)
                        )
                    ),
                ),
            )
        )
    kernels = getattr(muon_alg, "kernels", None)
    if hasattr(kernels, "bmm_add"):
        # the same iteration with torch.baddbmm as its sum (the copy of X bmm_add skips), so
        # the gain of bmm_add is measured in the same run
        variants.append(
            (
                "shardopt_batched_baddbmm",
                lambda st: _with_baddbmm(
                    kernels, lambda: [muon_alg.newton_schulz(x, coefficients, EPS) for x in st]
                ),
            )
        )
    matmul = getattr(kernels, "matmul", None)
    if hasattr(matmul, "SYMMETRIC_BAND_ROWS"):
        # the symmetric products whole (the tree before symmetric_bmm_add), and with bands of
        # other heights than the default: the band rule measured in the same run
        for rows in SWEPT_BAND_ROWS:
            variants.append(
                (
                    f"shardopt_batched_bands{rows}" if rows else "shardopt_batched_whole",
                    lambda st, rows=rows: _with_band_rows(
                        matmul,
                        rows,
                        lambda: [muon_alg.newton_schulz(x, coefficients, EPS) for x in st],
                    ),
                )
            )
    if hasattr(kernels, "set_matmul_tuning"):
        # FusedMuon's own way (the "shardopt_batched" row) with cuBLASLt's algorithms timed
        default = dict(variants)["shardopt_batched"]
        for candidates in SWEPT_TUNING:
            variants.append(
                (
                    f"shardopt_batched_tuned{candidates}",
                    lambda st, n=candidates: _with_tuning(kernels, n, default(st)),
                )
            )
    gram = _shardopt_ns(muon_alg, "gram_newton_schulz")
    if gram is not None:
        variants.append(
            ("shardopt_gram_batched", lambda st: lambda: [gram(x, coefficients, EPS) for x in st])
        )
        # Gram in fp16, the precision it keeps the spec's accuracy in (docs/spec.md); its
        # stacks are made in fp16 below
        variants.append(("shardopt_gram_fp16_batched", variants[-1][1]))
    torch_ns = getattr(getattr(torch.optim, "_muon", None), "_zeropower_via_newtonschulz", None)
    if torch_ns is not None:
        variants.append(
            (
                "torch_one_at_a_time",
                lambda st: (
                    lambda: [
                        torch_ns(m, COEFFICIENTS, NS_STEPS, EPS) for x in st for m in x.unbind(0)
                    ]
                ),
            )
        )
    rows = []
    same_shape_tflops = None
    for what, build in variants:
        row: dict[str, Any] = {"kind": "ns", "set": set_name, "what": what, "flops": flops}
        stacks = None
        try:
            # newton_schulz normalises its input in place: later calls see a matrix of norm 1,
            # the same work on the same values
            stacks = _stacks(shapes, device, VARIANT_DTYPES.get(what, torch.bfloat16))
            ms = median(time_fn(build(stacks), device, **timing))
            row.update(ms=ms, tflops=_rate(flops, ms))
            if what == "gemm_same_shapes":
                same_shape_tflops = row["tflops"]
            if gemm_tflops:
                row["of_gemm"] = row["tflops"] / gemm_tflops
            if same_shape_tflops and what != "gemm_same_shapes":
                row["of_gemm_same_shapes"] = row["tflops"] / same_shape_tflops
        except Exception as exc:  # out of memory at a shape, a variant missing on this torch
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            stacks = None
            free_memory(device)
        rows.append(row)
    return rows
