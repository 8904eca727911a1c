"""The compact-state entry: Adam/AdamW over DistributedFusedAdam's compact storage (int16
remainders, 16-bit, scaled fp16 and int8 moments; docs/spec.md "Compact state formats"), checked
against its ``state_format`` and run by the ``adam_compact`` (elementwise formats) or
``adam_blockwise`` (per-block scales) kernel (``kernels.ops``)."""

from __future__ import annotations

from torch import Tensor

from shardopt import state_codec
from shardopt.kernels import ops
from shardopt.kernels.dispatch import TensorLists

_COMPACT_SLOTS = (
    "grads",
    "params",
    "remainders",
    "exp_avg",
    "exp_avg_sq",
    "exp_avg_scales",
    "exp_avg_sq_scales",
)


def adam_compact(
    lists: TensorLists,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    adam_w_mode: bool,
    bias_correction: bool,
    weight_decay: float,
    state_format: str,
    lr_t: Tensor | None = None,
    step_t: Tensor | None = None,
    grad_scale_t: Tensor | None = None,
    found_inf_t: Tensor | None = None,
) -> None:
    """Adam/AdamW over compact state (docs/spec.md "Compact state formats"), in place.

    Args:
        lists: ``[grads, params, remainders, exp_avg, exp_avg_sq, exp_avg_scales,
            exp_avg_sq_scales]``, one tensor per param in each non-empty list. grads: fp32, bf16
            or fp16. params: the fp32 master; or bf16 with int16 ``remainders`` (the master is
            ``state_codec.join_master(param, remainder)``, written back split); or bf16/fp16 with
            ``remainders`` empty (the param is the master, stored rounded to nearest even).
            exp_avg / exp_avg_sq: codes of ``state_format`` (m with the signed map, v with the
            unsigned one, as its root in ``state_codec.ROOT_FORMATS``). The scale lists: one
            fp32 tensor of ``state_codec.num_blocks(numel)`` elements per param for scaled_fp16
            and int8, else empty.
        lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay: as ``adam``.
        state_format: one of ``state_codec.FORMATS``.
        lr_t, step_t, grad_scale_t, found_inf_t: optional 1-element fp32 device scalars, as
            ``adam`` (a nonzero ``found_inf_t`` changes nothing).

    Raises:
        ValueError: unknown format, not 7 lists, or scales given to an elementwise format.
        TypeError: codes of another dtype than the format's.
        RuntimeError: (from the kernel) any other list, dtype, size or device mismatch.

    Example:
        >>> lists = [[g], [p], [], [m], [v], [], []]  # fp32 master, bf16 moments
        >>> adam_compact(lists, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1,
        ...              adam_w_mode=True, bias_correction=True, weight_decay=0.0,
        ...              state_format="bf16")
    """
    codes = state_codec.code_dtype(state_format)
    if len(lists) != len(_COMPACT_SLOTS):
        raise ValueError(
            f"adam_compact: expected 7 tensor lists [{', '.join(_COMPACT_SLOTS)}], got {len(lists)}"
        )
    lists = [list(lst) for lst in lists]
    for k in (3, 4):
        for i, t in enumerate(lists[k]):
            if t.dtype != codes:
                raise TypeError(
                    f"adam_compact: tensor {i} of {_COMPACT_SLOTS[k]} is {t.dtype}, but "
                    f"state_format={state_format!r} stores {codes} codes"
                )
    blockwise = state_codec.has_scales(state_format)
    if not blockwise and (lists[5] or lists[6]):
        raise ValueError(
            f"adam_compact: state_format={state_format!r} has no scales; pass empty "
            "exp_avg_scales and exp_avg_sq_scales lists"
        )
    if not lists[0]:
        return
    kernel = ops.adam_blockwise if blockwise else ops.adam_compact
    kernel(
        lists,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        step=step,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        weight_decay=weight_decay,
        lr_t=lr_t,
        step_t=step_t,
        grad_scale_t=grad_scale_t,
        found_inf_t=found_inf_t,
    )
