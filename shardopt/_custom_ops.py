"""The fused Adam and SGD kernels as ``torch.library`` custom ops, for ``torch.compile``.

``shardopt::adam`` and ``shardopt::sgd`` take the kernels' tensor lists and scalars, mutate the
params, state and optional outputs in place and return nothing; their fake (meta)
implementations do nothing, so Dynamo and AOTAutograd trace a call without running it and the
compiled graph calls the kernel as one opaque node. ``shardopt._ops.adam``/``sgd`` route here
only while Dynamo traces (``torch.compiler.is_compiling()``); eager calls go straight to the
kernels (no dispatcher overhead). Only the plain ``float``/``int``/``bool`` and optional device
scalar arguments the kernels take are accepted (see csrc/kernels.h).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardopt import _ops


def _lists(grads, params, state, outs):
    return [grads, params, *state] + ([outs] if outs else [])


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
    lr_t: Tensor | None = None,
    step_t: Tensor | None = None,
    grad_scale_t: Tensor | None = None,
    found_inf_t: Tensor | None = None,
) -> None:
    scalars = {
        k: v
        for k, v in dict(
            lr_t=lr_t, step_t=step_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t
        ).items()
        if v is not None
    }
    _ops.adam(
        _lists(grads, params, [exp_avg, exp_avg_sq], outs),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        **scalars,
    )


@adam_op.register_fake
def _adam_fake(*args, **kwargs) -> None:
    return None


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
    lr_t: Tensor | None = None,
    grad_scale_t: Tensor | None = None,
    found_inf_t: Tensor | None = None,
) -> None:
    scalars = {
        k: v
        for k, v in dict(lr_t=lr_t, grad_scale_t=grad_scale_t, found_inf_t=found_inf_t).items()
        if v is not None
    }
    _ops.sgd(
        _lists(grads, params, [momentum_buffers], outs),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        first_run=first_run,
        wd_after_momentum=wd_after_momentum,
        scale=scale,
        **scalars,
    )


@sgd_op.register_fake
def _sgd_fake(*args, **kwargs) -> None:
    return None


def adam(lists, **kw) -> None:
    grads, params, exp_avg, exp_avg_sq, *rest = lists
    adam_op(
        list(grads),
        list(params),
        list(exp_avg),
        list(exp_avg_sq),
        list(rest[0]) if rest else [],
        **kw,
    )


def sgd(lists, **kw) -> None:
    grads, params, bufs, *rest = lists
    sgd_op(list(grads), list(params), list(bufs), list(rest[0]) if rest else [], **kw)
