"""Every kernel of ``shardopt._C`` as a ``torch.library`` custom op, for ``torch.compile``.

``shardopt::adam``, ``sgd``, ``adagrad``, ``lamb_stage1``, ``lamb_stage2``, ``novograd``,
``novograd_step``, ``norm`` and ``scale`` take the kernels' tensor lists and scalars and mutate in
place the slots the kernel writes (declared in ``mutates_args``; ``novograd_step`` also its
second-moment vector ``v``). Their fake (meta) implementations allocate only what
the kernel returns (``lamb_stage1``'s and ``norm``'s per-tensor sums, with the kernel's shape,
dtype and device), so Dynamo and AOTAutograd trace a call without running it and the compiled graph
calls the kernel as one opaque node. ``shardopt._ops`` routes its public wrappers here only while
Dynamo traces (``torch.compiler.is_compiling()``); eager calls go straight to the kernels (no
dispatcher overhead), and so does each op's real implementation, which calls ``shardopt._ops``
outside tracing. Only the plain ``float``/``int``/``bool`` and optional device scalar arguments
the kernels take are accepted (see csrc/kernels.h).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardopt import _ops

OptTensor = Tensor | None


def _lists(*slots: Sequence[Tensor], outs: Sequence[Tensor] = ()) -> list[list[Tensor]]:
    """The kernel's tensor lists: ``slots`` in order, then the out slot when there is one."""
    return [list(s) for s in slots] + ([list(outs)] if outs else [])


def _given(**scalars: OptTensor) -> dict[str, Tensor]:
    """The device scalars that were passed (an op's None is the kernel's missing argument)."""
    return {k: v for k, v in scalars.items() if v is not None}


def _split(lists, depth: int) -> tuple[list[list[Tensor]], list[Tensor | None]]:
    """``depth`` slots as lists, and the out slot ([] when absent) of an ``_ops`` call's lists."""
    outs = lists[depth] if len(lists) > depth else None
    return [list(s) for s in lists[:depth]], [] if outs is None else list(outs)


def _by_out(slots, outs, vectors: Sequence[Tensor | None] = (), index: list | None = None):
    """(slots, outs, per-tensor vectors) of the positions with an out, then of those without.

    A group mixing params with and without masters has None entries in its out slot, which the
    ops' ``Tensor[]`` cannot hold (and torch 2.13's auto-functionalization of a mutated
    ``Tensor?[]`` fails), so each kind gets its own call, as the eager path splits by dtype.
    ``index``, if given, receives each call's positions as a tensor (None: all of them).
    """
    have = [o is not None for o in outs]
    if all(have) or not any(have):
        if index is not None:
            index.append(None)
        yield slots, outs if any(have) else [], list(vectors)
        return
    for kind in (True, False):
        idx = [i for i, h in enumerate(have) if h == kind]
        sub = [[s[i] for i in idx] for s in slots]
        device = next(v.device for v in vectors if v is not None) if vectors else None
        positions = torch.tensor(idx, device=device) if device is not None else None
        if index is not None:
            index.append(positions)
        vecs = [None if v is None else v.index_select(0, positions) for v in vectors]
        yield sub, [outs[i] for i in idx] if kind else [], vecs


def _sums_dtype(tensors: Sequence[Tensor], every: bool) -> torch.dtype:
    """The kernels' per-tensor sums: fp64 for fp64 CPU tensors (all of them when ``every``, else
    any: one kernel call per dtype, results promoted), else fp32."""
    fp64 = [t.dtype == torch.float64 for t in tensors]
    cpu = bool(tensors) and tensors[0].device.type == "cpu"
    return torch.float64 if cpu and fp64 and (all(fp64) if every else any(fp64)) else torch.float32


# -- elementwise optimizers ---------------------------------------------------------------------


@torch.library.custom_op(
    "shardopt::adam", mutates_args=("params", "exp_avg", "exp_avg_sq", "outs"), device_types=None
)
def adam_op(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    outs: list[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    adam_w_mode: bool,
    bias_correction: bool,
    weight_decay: float,
    lr_t: OptTensor = None,
    step_t: OptTensor = None,
    grad_scale_t: OptTensor = None,
    found_inf_t: OptTensor = None,
) -> None:
    _ops.adam(
        _lists(grads, params, exp_avg, exp_avg_sq, outs=outs),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        **_given(lr_t=lr_t, step_t=step_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t),
    )


@torch.library.custom_op(
    "shardopt::sgd", mutates_args=("params", "momentum_buffers", "outs"), device_types=None
)
def sgd_op(
    grads: list[Tensor],
    params: list[Tensor],
    momentum_buffers: list[Tensor],
    outs: list[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float,
    lr_t: OptTensor = None,
    grad_scale_t: OptTensor = None,
    found_inf_t: OptTensor = None,
    first_run_t: OptTensor = None,
) -> None:
    _ops.sgd(
        _lists(grads, params, momentum_buffers, outs=outs),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        first_run=first_run,
        wd_after_momentum=wd_after_momentum,
        scale=scale,
        **_given(
            lr_t=lr_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t, first_run_t=first_run_t
        ),
    )


@torch.library.custom_op(
    "shardopt::adagrad", mutates_args=("params", "sums", "outs"), device_types=None
)
def adagrad_op(
    grads: list[Tensor],
    params: list[Tensor],
    sums: list[Tensor],
    outs: list[Tensor],
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
    lr_t: OptTensor = None,
    grad_scale_t: OptTensor = None,
    found_inf_t: OptTensor = None,
) -> None:
    _ops.adagrad(
        _lists(grads, params, sums, outs=outs),
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        adagrad_w_mode=adagrad_w_mode,
        **_given(lr_t=lr_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t),
    )


@torch.library.custom_op(
    "shardopt::novograd", mutates_args=("params", "exp_avg", "outs"), device_types=None
)
def novograd_op(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avg: list[Tensor],
    outs: list[Tensor],
    v_norm: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    moment_mode: int,
    lr_t: OptTensor = None,
    step_t: OptTensor = None,
    grad_scale_t: OptTensor = None,
    found_inf_t: OptTensor = None,
) -> None:
    _ops.novograd(
        _lists(grads, params, exp_avg, outs=outs),
        v_norm,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        grad_averaging=grad_averaging,
        moment_mode=moment_mode,
        **_given(lr_t=lr_t, step_t=step_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t),
    )


@torch.library.custom_op(
    "shardopt::novograd_step", mutates_args=("params", "exp_avg", "outs", "v"), device_types=None
)
def novograd_step_op(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avg: list[Tensor],
    outs: list[Tensor],
    v: Tensor,
    fresh: OptTensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    moment_mode: int,
    norm_type: int,
    init_zero: bool,
    lr_t: OptTensor = None,
    step_t: OptTensor = None,
) -> None:
    _ops.novograd_step(
        _lists(grads, params, exp_avg, outs=outs),
        v,
        fresh,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        grad_averaging=grad_averaging,
        moment_mode=moment_mode,
        norm_type=norm_type,
        init_zero=init_zero,
        **_given(lr_t=lr_t, step_t=step_t),
    )


# -- LAMB's two stages ----------------------------------------------------------------------------


@torch.library.custom_op(
    "shardopt::lamb_stage1", mutates_args=("exp_avg", "exp_avg_sq"), device_types=None
)
def lamb_stage1_op(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool,
    adam_w_mode: bool,
    step_t: OptTensor = None,
    grad_scale_t: OptTensor = None,
    found_inf_t: OptTensor = None,
    grad_norm_sq_t: OptTensor = None,
    max_grad_norm: float = 0.0,
) -> tuple[Tensor, Tensor]:
    w_sq, u_sq = _ops.lamb_stage1(
        _lists(grads, params, exp_avg, exp_avg_sq),
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        grad_averaging=grad_averaging,
        adam_w_mode=adam_w_mode,
        max_grad_norm=max_grad_norm,
        **_given(
            step_t=step_t,
            grad_scale_t=grad_scale_t,
            found_inf_t=found_inf_t,
            grad_norm_sq_t=grad_norm_sq_t,
        ),
    )
    return w_sq, u_sq.clone()  # the CUDA kernel's two sums are rows of one tensor: no aliasing


@lamb_stage1_op.register_fake
def _lamb_stage1_fake(grads, params, *args, **kwargs) -> tuple[Tensor, Tensor]:
    device = params[0].device if params else torch.device("cpu")
    dtype = _sums_dtype(params, every=False)
    return tuple(torch.empty(len(params), dtype=dtype, device=device) for _ in range(2))


@torch.library.custom_op(
    "shardopt::lamb_stage2", mutates_args=("params", "outs"), device_types=None
)
def lamb_stage2_op(
    params: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    outs: list[Tensor],
    w_norm: Tensor,
    u_norm: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
    lr_t: OptTensor = None,
    step_t: OptTensor = None,
    found_inf_t: OptTensor = None,
    squared: bool = False,
) -> None:
    _ops.lamb_stage2(
        _lists(params, exp_avg, exp_avg_sq, outs=outs),
        w_norm,
        u_norm,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
        use_nvlamb=use_nvlamb,
        squared=squared,
        **_given(lr_t=lr_t, step_t=step_t, found_inf_t=found_inf_t),
    )


# -- norm and scale -------------------------------------------------------------------------------


@torch.library.custom_op("shardopt::norm", mutates_args=(), device_types=None)
def norm_op(tensors: list[Tensor], max_norm: bool) -> tuple[Tensor, Tensor]:
    return _ops.norm(tensors, max_norm)


@norm_op.register_fake
def _norm_fake(tensors, max_norm) -> tuple[Tensor, Tensor]:
    dtype, device = _sums_dtype(tensors, every=True), tensors[0].device
    return torch.empty((), dtype=dtype, device=device), torch.empty(
        len(tensors), dtype=dtype, device=device
    )


@torch.library.custom_op("shardopt::scale", mutates_args=("dst", "found_inf"), device_types=None)
def scale_op(
    src: list[Tensor], dst: list[Tensor], found_inf: Tensor, scale: float, scale_t: OptTensor
) -> None:
    _ops.scale(src, dst, found_inf, scale=scale, scale_t=scale_t)


for _op in (adam_op, sgd_op, adagrad_op, novograd_op, novograd_step_op, lamb_stage2_op, scale_op):
    _op.register_fake(lambda *args, **kwargs: None)  # in-place only: nothing to allocate


# -- what shardopt._ops calls while Dynamo traces (its wrappers' signatures) ---------------------


def adam(lists, **kw) -> None:
    for slots, outs, _ in _by_out(*_split(lists, 4)):
        adam_op(*slots, outs, **kw)


def sgd(lists, **kw) -> None:
    for slots, outs, _ in _by_out(*_split(lists, 3)):
        sgd_op(*slots, outs, **kw)


def adagrad(lists, **kw) -> None:
    for slots, outs, _ in _by_out(*_split(lists, 3)):
        adagrad_op(*slots, outs, **kw)


def novograd(lists, v_norm: Tensor, **kw) -> None:
    for slots, outs, (v,) in _by_out(*_split(lists, 3), (v_norm,)):
        novograd_op(*slots, outs, v, **kw)


def novograd_step(lists, v: Tensor, fresh: OptTensor, **kw) -> None:
    index: list = []
    for k, (slots, outs, (sub_v, sub_fresh)) in enumerate(
        _by_out(*_split(lists, 3), (v, fresh), index)
    ):
        novograd_step_op(*slots, outs, sub_v, sub_fresh, **kw)
        if index[k] is not None:  # the op blended a copy of these entries
            v.index_copy_(0, index[k], sub_v)


def lamb_stage1(lists, **kw) -> tuple[Tensor, Tensor]:
    slots, _ = _split(lists, 4)
    return lamb_stage1_op(*slots, **kw)


def lamb_stage2(lists, w_norm: Tensor, u_norm: Tensor, **kw) -> None:
    for slots, outs, (w, u) in _by_out(*_split(lists, 3), (w_norm, u_norm)):
        lamb_stage2_op(*slots, outs, w, u, **kw)


def norm(tensors: Sequence[Tensor], max_norm: bool = False) -> tuple[Tensor, Tensor]:
    if not tensors:  # as the eager wrapper: nothing to trace
        z = torch.zeros((), dtype=torch.float32)
        return z, torch.zeros(0, dtype=torch.float32)
    return norm_op(list(tensors), max_norm)


def scale(src, dst, found_inf: Tensor, scale: float = 1.0, scale_t: OptTensor = None) -> None:
    scale_op(list(src), list(dst), found_inf, float(scale), scale_t)
