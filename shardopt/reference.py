"""Plain-PyTorch reference optimizers: the test oracle for every shardopt kernel.

Each update rule of the spec (docs/spec.md) is written here once, as a small function over
one tensor that follows the spec's pseudo-code line by line, so a reader can check it against the
spec without knowing anything about kernels, chunking or sharding. The classes wrap those functions
with torch.optim-style param groups and keep fp64 copies of the params (any float dtype on request).

This module is never used on a hot path: it is slow, allocates freely and exists only so tests can
compare the fused CPU/CUDA kernels and the ZeRO optimizers against it.

Conventions shared by every class (they are the spec's shared rules):

- ``step(grads)`` takes a flat sequence of grads aligned with :meth:`ReferenceOptimizer.params`.
  A ``None`` entry skips that param: its state is neither created nor advanced.
- Steps are counted per param group: ``group["step"]`` advances iff at least one of the group's
  params has a grad, and the bias corrections of every param in the group use that count.
- Hyperparameters are read from ``param_groups`` at every step, so tests can change ``group["lr"]``
  the way an lr scheduler does.
- ``state`` is keyed by the param's index in ``params()`` order.

Example:
    >>> ref = Adam([torch.ones(3)], lr=0.1, weight_decay=0.01)
    >>> ref.step([torch.full((3,), 0.5)])
    >>> ref.params()[0].dtype
    torch.float64
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "ReferenceOptimizer",
    "Adam",
    "LAMB",
    "NovoGrad",
    "SGD",
    "Adagrad",
    "adam_update",
    "lamb_update",
    "novograd_norm",
    "novograd_update",
    "sgd_update",
    "adagrad_update",
    "Muon",
    "muon_update",
    "newton_schulz",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# Update rules: one tensor at a time, line by line as in docs/spec.md; p and state change in place.
# ----------------------------------------------------------------------------------------------


def adam_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bc1: float,
    bc2: float,
) -> None:
    """Applies one FusedAdam step to ``p``, ``m`` (exp_avg) and ``v`` (exp_avg_sq) in place."""
    if not adam_w_mode:
        g = g + weight_decay * p
    m.copy_(beta1 * m + (1 - beta1) * g)
    v.copy_(beta2 * v + (1 - beta2) * g * g)
    u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if adam_w_mode:
        u = u + weight_decay * p
    p.copy_(p - lr * u)


def lamb_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    grad_norm: Tensor,
    max_grad_norm: float,
    lr: float,
    beta1: float,
    beta2: float,
    beta3: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
    bc1: float,
    bc2: float,
) -> None:
    """Applies one FusedLAMB step in place; ``grad_norm`` is the global norm over all groups."""
    if max_grad_norm > 0 and grad_norm > max_grad_norm:
        g = g / (grad_norm / max_grad_norm)
    if not adam_w_mode:
        g = g + weight_decay * p
    m.copy_(beta1 * m + beta3 * g)
    v.copy_(beta2 * v + (1 - beta2) * g * g)
    u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if adam_w_mode:
        u = u + weight_decay * p
    w_norm = torch.linalg.vector_norm(p)
    u_norm = torch.linalg.vector_norm(u)
    if (use_nvlamb or weight_decay != 0) and w_norm != 0 and u_norm != 0:
        ratio = lr * w_norm / u_norm
    else:
        ratio = lr
    p.copy_(p - ratio * u)


def novograd_norm(g: Tensor, norm_type: int) -> Tensor:
    """Returns NovoGrad's per-tensor grad norm: L2 (``norm_type=2``) or max-abs (``norm_type=0``).

    Raises:
        RuntimeError: ``norm_type`` is neither 2 nor 0.
    """
    if norm_type == 2:
        return torch.sqrt(torch.sum(g * g))
    if norm_type == 0:
        return torch.max(torch.abs(g))
    raise RuntimeError(f"NovoGrad supports norm_type 2 (L2) or 0 (inf) only, got {norm_type}")


def novograd_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    first_step: bool,
    init_zero: bool,
    norm_type: int,
    lr: float,
    beta1: float,
    beta2: float,
    beta3: float,
    eps: float,
    weight_decay: float,
    reg_inside_moment: bool,
    bc1: float,
    bc2: float,
) -> None:
    """Applies one FusedNovoGrad step in place.

    ``v`` is the 0-dim second moment stored as a norm (zero until the first step); ``first_step``
    says this is the param's first update; ``bc2`` is already ``sqrt(1 - beta2**t)``.
    """
    n = novograd_norm(g, norm_type)
    if first_step and not init_zero:
        v.copy_(n)
    elif norm_type == 2:
        v.copy_(torch.sqrt(beta2 * v * v + (1 - beta2) * n * n))
    else:
        v.copy_(beta2 * v + (1 - beta2) * n)
    if reg_inside_moment:
        g = g / (v / bc2 + eps) + weight_decay * p
        m.copy_(beta1 * m + beta3 * g)
        p.copy_(p - lr * m / bc1)
    else:
        m.copy_(beta1 * m + beta3 * g)
        p.copy_(p - lr * ((m / bc1) / (v / bc2 + eps) + weight_decay * p))


def sgd_update(
    p: Tensor,
    g: Tensor,
    buf: Tensor | None,
    *,
    scale: float,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    wd_after_momentum: bool,
) -> Tensor | None:
    """Applies one FusedSGD step to ``p`` in place and returns the momentum buffer.

    ``buf`` is ``None`` before the first step with momentum; the returned buffer is then new.
    """
    g = g * scale
    if weight_decay != 0 and not wd_after_momentum:
        g = g + weight_decay * p
    if momentum != 0:
        if buf is None:
            buf = g.clone()
        else:
            buf.copy_(momentum * buf + (1 - dampening) * g)
        g = g + momentum * buf if nesterov else buf
    if weight_decay != 0 and wd_after_momentum:
        g = g + weight_decay * p
    p.copy_(p - lr * g)
    return buf


def adagrad_update(
    p: Tensor,
    g: Tensor,
    h: Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
) -> None:
    """Applies one FusedAdagrad step to ``p`` and ``h`` (the ``sum`` state) in place."""
    if not adagrad_w_mode:
        g = g + weight_decay * p
        h.copy_(h + g * g)
        p.copy_(p - lr * g / (torch.sqrt(h) + eps))
    else:
        h.copy_(h + g * g)
        p.copy_(p - lr * (g / (torch.sqrt(h) + eps) + weight_decay * p))


#: Polar Express's five triples (Amsel et al., arXiv 2505.16932), as modded-nanogpt and Dion use
POLAR_EXPRESS = [
    (8.1566, -22.4833, 15.8788),
    (4.0429, -2.8089, 0.5000),
    (3.8917, -2.7725, 0.5061),
    (3.2858, -2.3681, 0.4645),
    (2.3465, -1.7098, 0.4232),
]


def newton_schulz(
    u: Tensor, coefficients: Sequence[tuple[float, float, float]], eps: float
) -> Tensor:
    """Returns torch.optim.Muon's orthogonalization of the matrix ``u``, in ``u``'s dtype.

    ``X = u / max(||u||_F, eps)`` (transposed first when tall), then per ``(a, b, c)``:
    ``A = X Xᵀ``, ``X = a X + (b A + c A A) X``; transposed back.
    """
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / torch.clamp(torch.linalg.vector_norm(x), min=eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if u.shape[0] > u.shape[1] else x


def muon_update(
    p: Tensor,
    g: Tensor,
    buf: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    coefficients: Sequence[tuple[float, float, float]],
    eps: float,
    adjust_lr_fn: str | None,
    flatten: bool,
    ns_split: Any = None,
) -> None:
    """Applies one FusedMuon step to ``p`` and ``buf`` (the momentum buffer) in place.

    A 2-D ``p`` is one matrix; with more dims, one matrix per index of the leading dims (the last
    two dims are the matrix), or with ``flatten`` one ``(shape[0], rest)`` matrix (conv weights).
    ``ns_split`` cuts each matrix into row blocks (an int: blocks of that many rows; a sequence:
    the block sizes), each orthogonalized on its own. The lr's shape scale comes from each
    (block) matrix: ``sqrt(max(1, A/B))`` ("original", None) or ``0.2 sqrt(max(A, B))``
    ("match_rms_adamw"); the decay uses the unadjusted lr.
    """
    buf.copy_(momentum * buf + (1 - momentum) * g)
    u = (1 - momentum) * g + momentum * buf if nesterov else buf
    if flatten:
        matrices = u.reshape(1, u.shape[0], -1)
    else:
        matrices = u.reshape(-1, u.shape[-2], u.shape[-1])
    rows, cols = matrices.shape[1:]
    if ns_split is None:
        sizes = [rows]
    elif isinstance(ns_split, int):
        sizes = [ns_split] * (rows // ns_split)
    else:
        sizes = list(ns_split)
    blocks = []
    for block in torch.split(matrices, sizes, dim=1):
        a, b = block.shape[1:]
        if adjust_lr_fn == "match_rms_adamw":
            ratio = 0.2 * math.sqrt(max(a, b))
        else:
            ratio = math.sqrt(max(1.0, a / b))
        blocks.append(ratio * torch.stack([newton_schulz(m, coefficients, eps) for m in block]))
    o = torch.cat(blocks, dim=1).reshape(p.shape)
    p.copy_(p * (1 - lr * weight_decay) - lr * o)


# ----------------------------------------------------------------------------------------------
# Optimizer classes: param groups, state and step counting around the rules above.
# ----------------------------------------------------------------------------------------------

_Pairs = list[list[tuple[int, Tensor, Tensor]]]


class ReferenceOptimizer:
    """Base: holds fp64 copies of params and per-param state; param groups like torch.optim.

    Args:
        params: Tensors, or dicts ``{"params": [...], **overrides}`` as in torch.optim. Each param
            is cloned, detached and converted to ``dtype``; the caller's tensors are never touched.
        defaults: Hyperparameters every group starts from; a group's own keys override them.
        dtype: Dtype of the param copies, their state and all the math.

    Raises:
        ValueError: ``params`` is empty.
    """

    def __init__(
        self, params: Iterable[Any], defaults: dict, dtype: torch.dtype = torch.float64
    ) -> None:
        self.defaults = dict(defaults)
        self.dtype = dtype
        self.state: dict[int, dict[str, Tensor]] = {}
        entries = list(params)
        if not entries:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(entries[0], dict):
            entries = [{"params": entries}]
        self.param_groups: list[dict[str, Any]] = []
        for entry in entries:
            group = {**self.defaults, **entry}
            tensors = [entry["params"]] if isinstance(entry["params"], Tensor) else entry["params"]
            group["params"] = [t.detach().to(dtype=dtype, copy=True) for t in tensors]
            group["step"] = 0
            self.param_groups.append(group)

    def params(self) -> list[Tensor]:
        """Returns all params, in group order."""
        return [p for group in self.param_groups for p in group["params"]]

    def step(self, grads: Sequence[Tensor | None]) -> None:
        """Applies one step; ``grads`` aligns with :meth:`params`, ``None`` skips a param."""
        self._step(self._pair(grads))

    def _pair(self, grads: Sequence[Tensor | None]) -> _Pairs:
        """Returns (index, param, grad in param dtype) triples per group, dropping None grads."""
        grads = list(grads)
        if len(grads) != len(self.params()):
            raise ValueError(f"expected {len(self.params())} grads, got {len(grads)}")
        pairs: _Pairs = []
        index = 0
        for group in self.param_groups:
            pairs.append([])
            for p in group["params"]:
                g = grads[index]
                if g is not None:
                    g = g.detach().to(device=p.device, dtype=p.dtype)
                    pairs[-1].append((index, p, g))
                index += 1
        return pairs

    def _step(self, pairs: _Pairs, **extra: Any) -> None:
        """Advances each group with at least one grad and updates its params."""
        for group, group_pairs in zip(self.param_groups, pairs, strict=True):
            if not group_pairs:
                continue
            group["step"] += 1
            for index, p, g in group_pairs:
                self._update(group, self.state.setdefault(index, {}), p, g, **extra)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        """Updates one param; ``state`` is empty on the param's first update."""
        raise NotImplementedError


def _check_amsgrad(amsgrad: bool, name: str) -> None:
    """Raises the spec's RuntimeError for ``amsgrad=True``."""
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")


def _bias_corrections(group: dict) -> tuple[float, float]:
    """Returns ``(1 - beta1**t, 1 - beta2**t)``, or ``(1, 1)`` without bias correction."""
    beta1, beta2 = group["betas"]
    t = group["step"]
    if not group["bias_correction"]:
        return 1.0, 1.0
    return 1 - beta1**t, 1 - beta2**t


class Adam(ReferenceOptimizer):
    """FusedAdam: Adam (``adam_w_mode=False``, L2) or AdamW (``adam_w_mode=True``, decoupled).

    Flags that only matter to the fused implementation (``set_grad_none``, ``capturable``,
    ``master_weights``) are accepted and ignored.

    Raises:
        RuntimeError: ``amsgrad=True``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        _check_amsgrad(amsgrad, "Adam")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, dtype)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        bc1, bc2 = _bias_corrections(group)
        adam_update(
            p,
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=group["adam_w_mode"],
            bc1=bc1,
            bc2=bc2,
        )


class LAMB(ReferenceOptimizer):
    """FusedLAMB, with global-norm clipping over the grads of all groups.

    ``max_grad_norm`` is read from the constructor defaults (not per group); 0 turns clipping off.

    Raises:
        RuntimeError: ``amsgrad=True``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        _check_amsgrad(amsgrad, "LAMB")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )
        super().__init__(params, defaults, dtype)

    def step(self, grads: Sequence[Tensor | None], grad_scale: float = 1.0) -> None:
        """Applies one step; grads are multiplied by ``grad_scale`` before the global norm."""
        pairs = [[(i, p, g * grad_scale) for i, p, g in group] for group in self._pair(grads)]
        squares = [torch.sum(g * g) for group in pairs for _, _, g in group]
        grad_norm = (
            torch.sqrt(torch.stack(squares).sum()) if squares else torch.zeros((), dtype=self.dtype)
        )
        self._step(pairs, grad_norm=grad_norm)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        bc1, bc2 = _bias_corrections(group)
        lamb_update(
            p,
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            grad_norm=extra["grad_norm"],
            max_grad_norm=self.defaults["max_grad_norm"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            beta3=(1 - beta1) if group["grad_averaging"] else 1.0,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=group["adam_w_mode"],
            use_nvlamb=group["use_nvlamb"],
            bc1=bc1,
            bc2=bc2,
        )


class NovoGrad(ReferenceOptimizer):
    """FusedNovoGrad: per-tensor second moment kept as a norm (L2 or inf).

    Unlike Apex's per-group vector, ``state[i]["exp_avg_sq"]`` is one 0-dim tensor per param; the
    numbers are the same.

    Raises:
        RuntimeError: ``amsgrad=True``, or a group's ``norm_type`` is neither 2 nor 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        _check_amsgrad(amsgrad, "NovoGrad")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            reg_inside_moment=reg_inside_moment,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(params, defaults, dtype)
        for group in self.param_groups:
            if group["norm_type"] not in (0, 2):
                raise RuntimeError(
                    f"NovoGrad supports norm_type 2 (L2) or 0 (inf) only, got {group['norm_type']}"
                )

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        first_step = not state
        if first_step:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
        beta1, beta2 = group["betas"]
        bc1, bc2 = _bias_corrections(group)
        novograd_update(
            p,
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            first_step=first_step,
            init_zero=group["init_zero"],
            norm_type=group["norm_type"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            beta3=(1 - beta1) if group["grad_averaging"] else 1.0,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            reg_inside_moment=group["reg_inside_moment"],
            bc1=bc1,
            bc2=math.sqrt(bc2),
        )


class SGD(ReferenceOptimizer):
    """FusedSGD, identical to torch.optim.SGD plus ``wd_after_momentum`` and a grad ``scale``.

    Raises:
        TypeError: ``lr`` is missing.
        ValueError: a group has ``nesterov=True`` with ``momentum <= 0`` or ``dampening != 0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )
        super().__init__(params, defaults, dtype)
        for group in self.param_groups:
            if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
                raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def step(self, grads: Sequence[Tensor | None], scale: float = 1.0) -> None:
        """Applies one step; grads are multiplied by ``scale`` (the inverse loss scale) first."""
        self._step(self._pair(grads), scale=scale)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        buf = sgd_update(
            p,
            g,
            state.get("momentum_buffer"),
            scale=extra["scale"],
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            nesterov=group["nesterov"],
            wd_after_momentum=group["wd_after_momentum"],
        )
        if buf is not None:
            state["momentum_buffer"] = buf


class Adagrad(ReferenceOptimizer):
    """FusedAdagrad: torch.optim.Adagrad (lr_decay 0, initial accumulator 0), or decoupled decay."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode)
        super().__init__(params, defaults, dtype)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        if not state:
            state["sum"] = torch.zeros_like(p)
        adagrad_update(
            p,
            g,
            state["sum"],
            lr=group["lr"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adagrad_w_mode=group["adagrad_w_mode"],
        )


class Muon(ReferenceOptimizer):
    """FusedMuon (torch.optim.Muon's rule, Newton-Schulz in ``dtype``), with AdamW groups.

    A group with ``use_muon=False`` is updated by :func:`adam_update` (FusedAdam's rule); its
    missing hyperparameters are FusedAdam's defaults, not this class's. ``ns_coefficients`` is
    one triple for every step, one triple per step or a preset name (Polar Express);
    ``ns_dtype`` and ``ns_algorithm`` are ignored (the math is in ``dtype``; Gram Newton-Schulz is
    the same map as the standard iteration in exact arithmetic).
    """

    ADAM_DEFAULTS = dict(
        lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
        weight_decay=0.0,
    )  # fmt: skip

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: Any = None,
        flatten: bool = False,
        ns_algorithm: str = "standard",
        ns_split: Any = None,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, flatten=flatten, ns_split=ns_split, use_muon=True,
        )  # fmt: skip
        entries = list(params)
        if entries and isinstance(entries[0], dict):
            entries = [
                {**self.ADAM_DEFAULTS, **e} if e.get("use_muon", True) is False else e
                for e in entries
            ]
        super().__init__(entries, defaults, dtype)

    def _update(self, group: dict, state: dict, p: Tensor, g: Tensor, **extra: Any) -> None:
        if not group["use_muon"]:
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            bc1, bc2 = _bias_corrections(group)
            adam_update(
                p, g, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"],
                bc1=bc1, bc2=bc2,
            )  # fmt: skip
            return
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        coefficients = group["ns_coefficients"]
        if coefficients == "polar_express":
            coefficients = POLAR_EXPRESS[: group["ns_steps"]]
            coefficients += [POLAR_EXPRESS[-1]] * (group["ns_steps"] - len(coefficients))
        elif all(isinstance(c, (int, float)) for c in coefficients):
            coefficients = [tuple(coefficients)] * group["ns_steps"]
        muon_update(
            p, g, state["momentum_buffer"], lr=float(group["lr"]),
            weight_decay=group["weight_decay"], momentum=group["momentum"],
            nesterov=group["nesterov"], coefficients=coefficients, eps=group["eps"],
            adjust_lr_fn=group["adjust_lr_fn"], flatten=group["flatten"],
            ns_split=group.get("ns_split"),
        )  # fmt: skip
