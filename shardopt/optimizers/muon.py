"""``FusedMuon`` (drop-in for torch.optim.Muon): Muon with Newton-Schulz batched by shape, and
AdamW groups in the same optimizer.

The algorithm (hyperparameters, defaults, checks, the Newton-Schulz iteration) is
shardopt/algorithms/muon.py; the AdamW groups run FusedAdam's kernels (shardopt/algorithms/adam.py).
The elementwise parts of Muon are two fused kernels (``muon.momentum_and_mix``,
``muon.decay_and_apply``: csrc/optim/muon_math.h).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from shardopt.algorithms import adam, muon
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers.fused_optimizer import FusedOptimizer
from shardopt.optimizers.muon_step import drop_muon_steps, muon_step, shape_batches
from shardopt.optimizers.state_dict import check_state_keys

H = muon.Hyperparams  # the defaults below are the algorithm's

#: what a ``use_muon=False`` group takes for the hyperparameters it does not give (FusedAdam's)
ADAMW_DEFAULTS = adam.Hyperparams().group_defaults()
#: the entries of a Muon group that an AdamW group does not have
MUON_ONLY = tuple(
    f.name for f in dataclasses.fields(muon.Hyperparams) if f.name not in ADAMW_DEFAULTS
)


class FusedMuon(FusedOptimizer):
    """Muon, as ``torch.optim.Muon`` computes it, with Newton-Schulz batched over same-shape
    matrices; AdamW for the param groups marked ``use_muon=False``.

    A drop-in replacement for ``torch.optim.Muon`` (same arguments, defaults, update and state
    dict: ``momentum_buffer`` per param, torch's group keys; it loads torch's state dicts and
    writes ones torch loads), with these additions: params of 3 or more dims (one matrix per
    index of the leading dims, or with ``flatten=True`` one ``(shape[0], rest)`` matrix: conv
    weights), per-step coefficients (``ns_coefficients`` as ``ns_steps`` triples: Polar Express),
    ``ns_dtype``, fp32 masters of fp16/bf16 params (``master_weights``) and AdamW groups
    (``shardopt.muon_param_groups`` splits a model). Unlike torch 2.13, the momentum buffer of a
    bf16 param with ``nesterov=False`` is not divided by its norm in place (docs/spec.md
    "FusedMuon"). The momentum buffer has the param's dtype, as torch's (fp32 beside fp32
    masters); AdamW groups keep fp32 state for fp16/bf16 params, as FusedAdam.

    All matrices of one shape in a group are orthogonalized together, one ``bmm`` chain in
    ``ns_dtype`` (torch's iteration, or with ``ns_algorithm="gram"`` Gram Newton-Schulz). The
    momentum with the Nesterov mix is one fused kernel pass that writes the Newton-Schulz input
    straight into the stack in ``ns_dtype``; the decay and the apply (with the cast into
    16-bit params beside fp32 masters) are a second one. AdamW groups run
    FusedAdam's fused kernels; their missing hyperparameters are FusedAdam's defaults (lr 1e-3,
    betas (0.9, 0.999), eps 1e-8, weight_decay 0, adam_w_mode and bias_correction on), not this
    constructor's.

    Args:
        params: iterable of params or of param-group dicts; a dict may hold ``use_muon=False``
            (AdamW, with FusedAdam's keys ``lr``, ``betas``, ``eps``, ``weight_decay``, ...) or
            any of the Muon hyperparameters below.
        lr: learning rate (a float or a 1-element tensor, read as a number each step).
        weight_decay: decoupled decay ``p *= 1 - lr * weight_decay`` (the unadjusted lr).
        momentum: EMA coefficient of the momentum buffer.
        nesterov: orthogonalize ``grad.lerp(buf, momentum)`` instead of the buffer.
        ns_coefficients: one ``(a, b, c)`` triple for every step, ``ns_steps`` triples, or a
            preset name (``"polar_express"``).
        eps: lower clamp of each matrix's Frobenius norm.
        ns_steps: Newton-Schulz steps (< 100).
        adjust_lr_fn: None / "original" (``sqrt(max(1, A/B))``) or "match_rms_adamw"
            (``0.2 * sqrt(max(A, B))``) for an A x B matrix.
        ns_dtype: dtype of the Newton-Schulz matmuls (bf16 as torch, or fp32, fp16, fp64).
        flatten: a param of 3+ dims is one ``(shape[0], rest)`` matrix instead of a stack.
        ns_algorithm: "standard" (torch's) or "gram" (Gram Newton-Schulz: fewer FLOPs on wide
            or tall matrices; square ones run the standard iteration). Use it with
            ``ns_dtype=torch.float16``: in bf16 it is a coarser rounding (docs/spec.md).
        ns_split: orthogonalize row blocks of each matrix separately, each with its own shape
            scale: an int (blocks of that many rows: per head of a fused QKV) or row sizes
            summing to the rows (q, k, v; gate, up). Usually set per param group.
        capturable: the lr is read on the device (a tensor lr stays there) and no step syncs
            with the host, so a step can be captured in a CUDA graph.
        master_weights: keep fp32 masters of fp16/bf16 params; the update is applied to the
            master and the rounded master written into the param.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        foreach, fused: accepted for torch.optim compatibility; no effect.
        differentiable: must be False (True raises NotImplementedError).

    Raises:
        ValueError: an ``ns_split`` that does not fit a param's rows; a Muon param with fewer
            than 2 dims (torch's message, with the way out);
            the hyperparameter errors of torch.optim.Muon (negative lr, momentum, weight decay,
            an unknown ``adjust_lr_fn``, ``ns_steps >= 100``, coefficients not triples).
        TypeError: a param of a dtype other than fp32, fp16, bf16, fp64; a bad ``ns_dtype``.
        RuntimeError: sparse grads; params of one group on several devices.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = FusedMuon([model[0].weight, model[1].weight], lr=0.02)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = muon.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = H.lr,
        weight_decay: float = H.weight_decay,
        momentum: float = H.momentum,
        nesterov: bool = H.nesterov,
        ns_coefficients: Any = H.ns_coefficients,
        eps: float = H.eps,
        ns_steps: int = H.ns_steps,
        adjust_lr_fn: str | None = H.adjust_lr_fn,
        ns_dtype: torch.dtype = H.ns_dtype,
        flatten: bool = H.flatten,
        ns_algorithm: str = H.ns_algorithm,
        ns_split: Any = H.ns_split,
        *,
        capturable: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = muon.Hyperparams(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            flatten=flatten,
            ns_algorithm=ns_algorithm,
            ns_split=ns_split,
        )
        check_torch_flags(
            type(self).__name__, foreach=foreach, fused=fused, differentiable=differentiable
        )
        super().__init__(
            params,
            hyper,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
            extra_defaults={"use_muon": True},
        )
        # torch.optim.Muon's state dict has no step; ours counts one only for the AdamW groups
        self.register_state_dict_post_hook(drop_muon_steps, prepend=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``; a ``use_muon=False`` group is AdamW (FusedAdam's
        defaults for what it does not give), every other group is checked as torch.optim.Muon
        checks its params (2 or more dims) and hyperparameters."""
        owner = type(self).__name__
        adamw = param_group.get("use_muon", True) is False
        if adamw:
            param_group = {**ADAMW_DEFAULTS, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if adamw:
            for name in MUON_ONLY:
                group.pop(name, None)
            fields = {f.name for f in dataclasses.fields(adam.Hyperparams)}
            adam.Hyperparams(**{k: v for k, v in group.items() if k in fields}).validate(owner)
            return
        group["use_muon"] = True
        muon.check_group(group, owner)
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"{owner} only supports 2D parameters (and stacks of them: 3 or more dims, "
                    f"one matrix per index of the leading dims) whereas we found a parameter "
                    f"with size: {p.size()}. Optimize it with AdamW: put it in a param group with "
                    "use_muon=False, or build the groups with shardopt.muon_param_groups(model)"
                )
            muon.matrix_blocks(p.shape, group["flatten"], group.get("ns_split"))

    def _plan_key(self, group: dict) -> Any:
        split = group.get("ns_split")
        split = split if split is None or isinstance(split, int) else tuple(split)
        return self.master_weights, group["use_muon"], group.get("flatten"), split

    @property
    def _step_supports_amp_scaling(self) -> bool:  # read by torch.amp.GradScaler
        # the Muon kernels take no grad_scale/found_inf: GradScaler unscales the grads itself
        return False

    def _buffer_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The momentum buffer's dtype: the param's, as torch.optim.Muon keeps it (the grad's),
        so that fp16/bf16 params round where torch's do; fp32 beside an fp32 master."""
        return torch.float32 if self._keeps_master(p) else p.dtype

    def _named_state(self, params: list, names: tuple[str, ...]) -> list[list[torch.Tensor]]:
        """Per-element state ``names`` of each param (zeros on first use, the param's layout)."""
        out: list[list[torch.Tensor]] = [[] for _ in names]
        for p in params:
            state = self._param_state(p)
            for k, name in enumerate(names):
                if name not in state:
                    dtype = self._buffer_dtype(p) if name in muon.STATE_NAMES else None
                    state[name] = torch.zeros_like(p, dtype=dtype or self._state_dtype(p))
                out[k].append(state[name])
        return out

    def _restore_state_tensor(self, key: str, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        restored = super()._restore_state_tensor(key, value, p)
        if key in muon.STATE_NAMES:
            return restored.to(self._buffer_dtype(p))
        return restored

    def _group_tensors(self, group: dict, params: list) -> tuple:
        math_params, outs = self._masters(params)
        if not group["use_muon"]:
            return math_params, outs, *self._named_state(params, adam.STATE_NAMES)
        (bufs,) = self._named_state(params, muon.STATE_NAMES)
        batches = shape_batches(params, group["flatten"], group.get("ns_split"))
        return math_params, outs, bufs, batches

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        if not group["use_muon"]:
            math_params, outs, exp_avg, exp_avg_sq = tensors
            adam.update(
                group, grads, math_params, exp_avg, exp_avg_sq, outs, step=group["step"],
                lr=group["lr"], as_is=as_is,
            )  # fmt: skip
            return
        math_params, outs, bufs, batches = tensors
        _, lr = self._step_and_lr(group, math_params[0].device)
        muon_step(group, grads, math_params, outs, bufs, batches, lr, as_is)

    def _check_state_keys(self, saved_state: dict, saved_groups: list[dict]) -> None:
        owner = type(self).__name__
        for group, saved in zip(self.param_groups, saved_groups):
            names = muon.STATE_NAMES if group["use_muon"] else adam.STATE_NAMES
            mine = {pid: saved_state[pid] for pid in saved["params"] if pid in saved_state}
            check_state_keys(mine, names, owner)
