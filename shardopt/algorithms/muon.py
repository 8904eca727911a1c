"""Muon: hyperparameters, their checks, the logical matrices of a param, the Newton-Schulz
iteration and the shape scale of the lr.

``FusedMuon`` (shardopt/optimizers/muon.py) takes ``Hyperparams``' defaults (torch.optim.Muon's)
and checks (torch's messages), and calls ``orthogonalize`` once per group of same-shape matrices
(a batched ``bmm`` chain: ``newton_schulz`` or ``gram_newton_schulz``). The elementwise parts are
two fused kernels (csrc/optim/muon_math.h), called through ``momentum_and_mix`` and
``decay_and_apply``; ``DistributedFusedMuon`` calls the same functions.

Note: the logical matrices of a Muon param
A 2-D param is one matrix (rows = ``shape[0]``, as torch). A param of more dims is a stack of
matrices over its leading dims, ``(prod(shape[:-2]), shape[-2], shape[-1])`` (MoE experts, stacked
layers), unless its group has ``flatten=True``: then it is one ``(shape[0], prod(shape[1:]))``
matrix (conv weights ``(out, in*kh*kw)``). The shape scale of the lr is taken from that matrix,
never from a flat shard or from ``shape[:2]`` of a stack.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import hyperparams
from shardopt.algorithms.validation import check_hyperparams

STATE_NAMES = ("momentum_buffer",)

#: Keller Jordan's quintic coefficients, torch.optim.Muon's default (one triple for every step)
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: named per-step coefficient sets (``ns_coefficients="polar_express"``): Polar Express (Amsel
#: et al., arXiv 2505.16932) as modded-nanogpt and Dion use it; later steps take its last triple
NS_PRESETS = {
    "polar_express": (
        (8.1566, -22.4833, 15.8788),
        (4.0429, -2.8089, 0.5000),
        (3.8917, -2.7725, 0.5061),
        (3.2858, -2.3681, 0.4645),
        (2.3465, -1.7098, 0.4232),
    ),
}

#: the dtypes Newton-Schulz may run in
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


@dataclasses.dataclass(frozen=True)
class Hyperparams(hyperparams.Hyperparams):
    """Muon's hyperparameters with torch.optim.Muon's defaults, in its positional order.

    Attributes:
        lr: learning rate (a float or a 1-element tensor, read as a host number each step).
        weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay`` (the unadjusted lr).
        momentum: EMA coefficient of the momentum buffer.
        nesterov: orthogonalize ``grad.lerp(buf, momentum)`` instead of the buffer.
        ns_coefficients: one ``(a, b, c)`` triple used at every Newton-Schulz step, or a sequence
            of ``ns_steps`` triples, one per step (Polar Express).
        eps: lower clamp of each matrix's Frobenius norm before the iteration.
        ns_steps: Newton-Schulz steps (< 100).
        adjust_lr_fn: the shape scale of the lr: None or "original" (``sqrt(max(1, A/B))``),
            "match_rms_adamw" (``0.2 * sqrt(max(A, B))``) for an A x B matrix.
        ns_dtype: the dtype of the Newton-Schulz matmuls (bf16 as torch; fp32 for accuracy).
        flatten: a param of 3 or more dims is one ``(shape[0], rest)`` matrix (conv weights)
            instead of a stack of matrices over its leading dims.
        ns_algorithm: "standard" (torch's iteration on X) or "gram" (on the Gram X Xᵀ of each
            wide matrix, fewer FLOPs for aspect ratios above about 1.5; see
            ``gram_newton_schulz``).
        ns_split: row blocks each logical matrix is orthogonalized as, each with its own shape
            scale: None, an int (blocks of that many rows: per head) or row sizes summing to
            the rows (q/k/v, gate/up); see ``matrix_blocks``.
    """

    lr: float | torch.Tensor = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: Any = DEFAULT_NS_COEFFICIENTS
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: torch.dtype = torch.bfloat16
    flatten: bool = False
    ns_algorithm: str = "standard"
    ns_split: Any = None

    def validate(self, owner: str) -> None:
        """torch.optim.Muon's checks with its messages, then shardopt's own.

        Raises:
            ValueError: a negative or NaN lr, momentum or weight decay; an unknown
                ``adjust_lr_fn``; ``ns_steps >= 100``; coefficients that are not triples, or a
                sequence of triples whose length is not ``ns_steps``; a negative eps.
            TypeError: an ``ns_dtype`` Newton-Schulz cannot run in.
        """
        check_group(self.group_defaults(), owner)


def check_group(group: dict[str, Any], owner: str) -> None:
    """Validates the Muon hyperparameters of one param group (see ``Hyperparams.validate``)."""
    lr = group["lr"]
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= group["momentum"]:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if group["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    coefficient_triples(group["ns_coefficients"], group["ns_steps"])
    if group.get("ns_algorithm", "standard") not in NS_ALGORITHMS:
        raise ValueError(
            f"{owner}: ns_algorithm must be one of {NS_ALGORITHMS}, got {group['ns_algorithm']!r}"
        )
    split = group.get("ns_split")
    if split is not None and not isinstance(split, numbers.Integral):
        split = tuple(split)
        if not split or not all(isinstance(s, numbers.Integral) for s in split):
            raise ValueError(f"{owner}: ns_split must be None, an int or row sizes, got {split!r}")
    if group["ns_dtype"] not in NS_DTYPES:
        raise TypeError(
            f"{owner}: ns_dtype must be one of {[str(d) for d in NS_DTYPES]}, got "
            f"{group['ns_dtype']!r}"
        )
    # eps and NaN checks as every algorithm's; nesterov needs no momentum here (torch's rule)
    check_hyperparams({k: group[k] for k in ("eps", "weight_decay", "momentum")}, owner)


def coefficient_triples(coefficients: Any, ns_steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of the ``ns_steps`` Newton-Schulz steps.

    ``coefficients`` may also name a preset of ``NS_PRESETS`` (its first ``ns_steps`` triples,
    the last one repeated past its end).

    Raises:
        ValueError: neither one triple, a sequence of ``ns_steps`` triples nor a preset name.
    """
    if isinstance(coefficients, str):
        if coefficients not in NS_PRESETS:
            raise ValueError(
                f"Unknown ns_coefficients preset {coefficients!r}; presets: {sorted(NS_PRESETS)}"
            )
        preset = NS_PRESETS[coefficients]
        return [preset[min(i, len(preset) - 1)] for i in range(ns_steps)]
    if len(coefficients) > 0 and all(isinstance(c, numbers.Real) for c in coefficients):
        if len(coefficients) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        return [tuple(float(c) for c in coefficients)] * ns_steps
    triples = [tuple(float(c) for c in triple) for triple in coefficients]
    if any(len(t) != 3 for t in triples) or len(triples) != ns_steps:
        raise ValueError(
            "Coefficients must be a tuple of exactly 3 values, or a sequence of ns_steps "
            f"({ns_steps}) such triples, one per step; got {coefficients!r}"
        )
    return triples


def matrix_shape(shape: Sequence[int], flatten: bool) -> tuple[int, int, int]:
    """``(count, rows, cols)``: the logical matrices of a param of ``shape`` (see Note: the
    logical matrices of a Muon param)."""
    if len(shape) < 2:
        raise ValueError(f"a Muon param needs 2 or more dims, got shape {tuple(shape)}")
    if flatten:
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


#: Newton-Schulz algorithms: "standard" (torch's, on X) or "gram" (on the n x n Gram X Xᵀ)
NS_ALGORITHMS = ("standard", "gram")

#: the steps after which Gram Newton-Schulz rebuilds X and its Gram (Dao-AILab/gram-newton-schulz)
GRAM_RESTARTS = (2,)


def ns_cost(
    shape: Sequence[int],
    flatten: bool = False,
    ns_steps: int = 5,
    ns_algorithm: str = "standard",
    ns_split: Any = None,
) -> float:
    """Newton-Schulz FLOPs of one step of a param of ``shape`` (its logical matrices, see Note:
    the logical matrices of a Muon param).

    Per n x m matrix (n <= m): standard ``(20 n²m + 10 n³) * ns_steps / 5`` (each step
    ``X Xᵀ``, ``A²`` and ``B X``, 2 FLOPs per multiply-add); Gram (``ns_algorithm="gram"``, a
    matrix with m > n; a square one runs the standard iteration) counts its products exactly
    (``8 n²m + 28 n³`` for 5 steps with the restart after step 2). Summed over the matrices.

    Args:
        shape: the param's shape (2 or more dims).
        flatten: the group's ``flatten``.
        ns_steps: Newton-Schulz steps.
        ns_algorithm: "standard" or "gram".
        ns_split: the group's ``ns_split`` (row blocks orthogonalized separately), or None.

    Returns:
        The FLOP count, a float (ranks are balanced by it: only ratios matter).

    Example:
        >>> ns_cost((4096, 4096))  # 30 n³
        2061584302080.0
    """
    total = 0.0
    for count, rows, cols in matrix_blocks(shape, flatten, ns_split):
        n, m = min(rows, cols), max(rows, cols)
        if ns_algorithm == "gram" and m > n:
            flops = _gram_flops(n, m, ns_steps)
        else:
            flops = (20.0 * n * n * m + 10.0 * n**3) * ns_steps / 5
        total += count * flops
    return total


def _gram_flops(n: int, m: int, ns_steps: int) -> float:
    """FLOPs of ``gram_newton_schulz`` on one n x m matrix (n < m), product by product."""
    restarts = [r for r in GRAM_RESTARTS if r < ns_steps]
    rect = 2.0 + 2.0 * len(restarts)  # X Xᵀ at the start and each restart, Q X at each and the end
    square = 0.0
    bounds = [0, *restarts, ns_steps]
    for start, stop in zip(bounds, bounds[1:]):
        for step in range(start, stop):
            square += 1  # R²
            square += step > start  # Q ← P Q (the first step of a segment takes Q = P)
            square += 2 * (step < stop - 1)  # R ← P R P, unless X is rebuilt next
    return rect * 2.0 * n * n * m + square * 2.0 * n**3


def matrix_blocks(
    shape: Sequence[int], flatten: bool, ns_split: Any = None
) -> list[tuple[int, int, int]]:
    """``[(count, rows, cols), ...]``: the matrices a param of ``shape`` is orthogonalized as:
    its logical matrices (``matrix_shape``), each cut into row blocks by ``ns_split``.

    ``ns_split`` None: no cut. An int ``r``: blocks of ``r`` rows (a fused QKV weight per head:
    ``r = head_dim``). A sequence of ints summing to the rows: blocks of those sizes, in order
    (q, k, v of a GQA layer; gate and up). Consecutive blocks of one shape are merged into one
    entry.

    Raises:
        ValueError: ``r`` does not divide the rows, or the sizes do not sum to them.
    """
    count, rows, cols = matrix_shape(shape, flatten)
    blocks: list[tuple[int, int, int]] = []
    for size in split_rows(rows, ns_split):
        if blocks and blocks[-1][1] == size:
            blocks[-1] = (blocks[-1][0] + count, size, cols)
        else:
            blocks.append((count, size, cols))
    return blocks


def split_rows(rows: int, ns_split: Any) -> list[int]:
    """The row-block sizes of an ``rows``-row matrix under ``ns_split`` (see ``matrix_blocks``)."""
    if ns_split is None:
        return [rows]
    if isinstance(ns_split, numbers.Integral):
        if ns_split <= 0 or rows % ns_split:
            raise ValueError(f"ns_split={ns_split} does not divide the {rows} rows of a matrix")
        return [int(ns_split)] * (rows // ns_split)
    sizes = [int(s) for s in ns_split]
    if any(s <= 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"ns_split={tuple(sizes)} does not sum to the {rows} rows of a matrix")
    return sizes


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's shape scale of the lr for a ``rows`` x ``cols`` matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _gram(x: torch.Tensor, tall: bool) -> torch.Tensor:
    """``X Xᵀ`` of the wide orientation: ``Xᵀ X`` of a tall stack, in its own layout; by its
    lower block rows on CUDA (``kernels.symmetric_bmm_add``), ``torch.bmm`` elsewhere."""
    return kernels.symmetric_bmm_add(x.mT, x) if tall else kernels.symmetric_bmm_add(x, x.mT)


def _left(m: torch.Tensor, x: torch.Tensor, tall: bool, beta: float = 0.0) -> torch.Tensor:
    """``beta X + M X`` of the wide orientation; for a tall stack the same products written
    in its own layout, ``beta X + X Mᵀ``: each entry the same products as torch's transposed
    form, and no transposed copy of the stack (neither into the chain nor out of it). The sum
    is ``kernels.bmm_add`` (baddbmm without its copy of X on CUDA)."""
    if tall:
        return torch.bmm(x, m.mT) if beta == 0.0 else kernels.bmm_add(x, m.mT, x, beta=beta)
    return torch.bmm(m, x) if beta == 0.0 else kernels.bmm_add(m, x, x, beta=beta)


def newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    eps: float,
) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of each matrix of the stack ``x`` (k, rows, cols),
    in ``x``'s dtype, one ``bmm`` chain for the whole stack; ``x`` is overwritten.

    As torch: each matrix is divided by its Frobenius norm clamped below at ``eps``; then per
    step ``A = X Xᵀ``, ``B = b A + c A²``, ``X = a X + B X``, on the wide orientation (torch
    transposes a tall matrix first; here a tall stack runs ``A = Xᵀ X``, ``X = a X + X Bᵀ`` in
    its own layout: the same products, and the result is contiguous in ``x``'s layout).
    """
    tall = x.size(-2) > x.size(-1)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norm.clamp_(min=eps))
    for a, b, c in coefficients:
        gram = _gram(x, tall)
        update = kernels.symmetric_bmm_add(gram, gram, gram, alpha=c, beta=b)
        x = _left(update, x, tall, beta=a)
    return x


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    eps: float,
    restarts: Sequence[int] = GRAM_RESTARTS,
) -> torch.Tensor:
    """``newton_schulz``'s result computed on the Gram matrix (Zhang, Amsel, Chen, Dao:
    Dao-AILab/gram-newton-schulz): for each n x m matrix (n < m; a tall stack runs the
    transposed products in its own layout, as ``newton_schulz``) with
    ``R = X Xᵀ``, a step ``X ← P X`` with ``P = a I + b R + c R²`` is ``R ← P R P``,
    ``Q ← P Q`` on n x n matrices only; X is rebuilt as ``Q X`` before each step of
    ``restarts`` (R recomputed from it, which bounds the drift of R in low precision) and at
    the end. Square stacks run ``newton_schulz`` (no saving). ``x`` is overwritten.

    FLOPs: ``ns_cost(..., ns_algorithm="gram")``; for 5 steps ``8 n²m + 28 n³`` against
    ``20 n²m + 10 n³``.
    """
    if x.size(-2) == x.size(-1):
        return newton_schulz(x, coefficients, eps)
    tall = x.size(-2) > x.size(-1)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norm.clamp_(min=eps))
    n = min(x.size(-2), x.size(-1))
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    steps = len(coefficients)
    gram = _gram(x, tall)
    q = None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts and q is not None:
            x = _left(q, x, tall)
            gram = _gram(x, tall)
            q = None
        poly = kernels.symmetric_bmm_add(gram, gram, gram, alpha=c, beta=b).add_(eye, alpha=a)
        q = poly if q is None else torch.bmm(poly, q)
        if i + 1 < steps and i + 1 not in restarts:
            gram = kernels.symmetric_bmm_add(poly, torch.bmm(gram, poly))
    if q is not None:
        x = _left(q, x, tall)
    return x


def orthogonalize(x: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The Newton-Schulz iteration of ``group`` (its algorithm, coefficients and eps) on the
    stack ``x`` (k, rows, cols), in ``x``'s dtype; ``x`` is overwritten."""
    coefficients = coefficient_triples(group["ns_coefficients"], group["ns_steps"])
    if group.get("ns_algorithm", "standard") == "gram":
        return gram_newton_schulz(x, coefficients, group["eps"])
    return newton_schulz(x, coefficients, group["eps"])


def momentum_and_mix(
    grads: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    mixes: Sequence[torch.Tensor],
    momentum: float,
    nesterov: bool,
    *,
    as_is: bool = False,
) -> None:
    """Muon's momentum and Newton-Schulz input, one fused pass (kernel ``muon_momentum``):
    ``buf ← buf.lerp(g, 1 − momentum)``; ``mix ← g.lerp(buf, momentum)`` with ``nesterov``,
    else a copy of ``buf``, rounded to the buffer's dtype as torch.optim.Muon's tensors are
    and written in the mixes' dtype (``ns_dtype``: the stack Newton-Schulz runs on).

    Preconditions: one numel per position; grads in the buffers' dtype, or fp16/bf16 beside
    fp32 buffers; mixes in any float dtype (views into a Newton-Schulz stack are fine). The
    buffers are never normalised in place (torch 2.13 does that to bf16 ones without Nesterov).

    Example:
        >>> g, buf, mix = [torch.ones(4, 4)], [torch.zeros(4, 4)], [torch.empty(4, 4)]
        >>> momentum_and_mix(g, buf, mix, momentum=0.95, nesterov=True)
        >>> float(buf[0][0, 0]), float(mix[0][0, 0])  # (1-μ)·g, then (1-μ)·g + μ·buf
        (0.05000000074505806, 0.09750001132488251)
    """
    kernels.muon_momentum(
        [list(grads), list(bufs), list(mixes)],
        momentum=float(momentum),
        nesterov=bool(nesterov),
        **kernels.as_is_kwargs(as_is),
    )


def decay_and_apply(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor | None] | None,
    lr: float | torch.Tensor,
    weight_decay: float,
    lr_ratio: float,
    *,
    as_is: bool = False,
) -> None:
    """Muon's decay and apply, one fused pass (kernel ``muon_apply``):
    ``p ← p·(1 − lr·weight_decay)`` (the unadjusted lr), then ``p ← p − lr·lr_ratio·update``,
    rounded as torch.optim.Muon's ``p.mul_`` and ``p.add_`` are; ``outs`` (fp16/bf16 params
    beside fp32 masters in ``params``, or None) get the rounded result in the same pass.

    Args:
        params: the params, or their fp32 masters.
        updates: the orthogonalized updates (``ns_dtype``), one per param, of its numel.
        outs: None, or one low-precision copy per param (None entries: no copy).
        lr: the unadjusted lr, a number or a 1-element tensor on the params' device (read in
            the kernel: no host sync, for capturable steps).
        weight_decay: decoupled decay.
        lr_ratio: the shape scale (``lr_ratio``) shared by every param of the call.

    Example:
        >>> p, u = [torch.ones(2, 2)], [torch.full((2, 2), 0.5, dtype=torch.bfloat16)]
        >>> decay_and_apply(p, u, None, lr=0.1, weight_decay=0.1, lr_ratio=1.0)
        >>> float(p[0][0, 0])  # 1 * (1 - 0.01) - 0.1 * 0.5
        0.9399999976158142
    """
    outs = list(outs) if outs is not None else [None] * len(params)
    lr_t = lr if torch.is_tensor(lr) and lr.device.type != "cpu" else None
    args = dict(
        lr=float(lr) if lr_t is None else 0.0,
        weight_decay=float(weight_decay),
        lr_ratio=float(lr_ratio),
        lr_t=lr_t,
        **kernels.as_is_kwargs(as_is),
    )
    for with_out in (False, True):  # params with a low-precision copy and those without
        idx = [i for i, o in enumerate(outs) if (o is not None) == with_out]
        if idx and not with_out and _torch_rounds_by_position(params[idx[0]], updates[idx[0]]):
            _apply_as_torch([params[i] for i in idx], [updates[i] for i in idx], lr, args)
        elif idx:
            lists = [[params[i] for i in idx], [updates[i] for i in idx]]
            kernels.muon_apply(lists + ([[outs[i] for i in idx]] if with_out else []), **args)


# Note: Muon's apply on 16-bit CPU params
# torch.optim.Muon's p.add_(update, alpha) on a bf16/fp16 CPU param with an update of its dtype
# rounds by position: ATen's vector loop computes fma(alpha, u, p) in fp32 with alpha rounded to
# the dtype, its scalar remainder (the last elements of each of its chunks, where the chunks fall
# depending on the CPU's vector width and torch's thread count) rounds alpha * u to the dtype
# first. No elementwise kernel can give both, so there FusedMuon runs torch's own mul_ and add_
# (foreach over the call) and keeps its bits; everywhere else (CUDA, fp32/fp64 params, fp32
# masters, an update of another dtype) muon_apply gives them in one pass.


def _torch_rounds_by_position(param: torch.Tensor, update: torch.Tensor) -> bool:
    """Whether ``param.add_(update)`` is the case of Note: Muon's apply on 16-bit CPU params."""
    half = (torch.bfloat16, torch.float16)
    return param.device.type == "cpu" and param.dtype in half and update.dtype == param.dtype


def _apply_as_torch(params: list, updates: list, lr: Any, args: dict) -> None:
    """torch.optim.Muon's ``p.mul_(1 - lr * wd)`` and ``p.add_(u, alpha=-lr * ratio)``."""
    lr = float(lr)
    decay = 1 - lr * args["weight_decay"]
    if decay != 1:  # a CPU 0-dim fp64 factor: the fp32 product of torch's p.mul_(float)
        torch._foreach_mul_(params, torch.tensor(decay, dtype=torch.float64))
    torch._foreach_add_(params, [u.reshape(p.shape) for p, u in zip(params, updates)],
                        alpha=-lr * args["lr_ratio"])  # fmt: skip
