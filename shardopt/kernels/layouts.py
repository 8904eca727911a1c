"""Fitting tensor lists to the kernels: which lists the kernels take as they are, and dense
temporaries for the tensors they cannot read as flat storage (see Note: layouts). Pure torch; the
dispatch point ``shardopt.kernels.dispatch`` calls it."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from shardopt.kernels.dtensor import any_dtensor

Tensor = torch.Tensor
TensorLists = Sequence[Sequence[Tensor]]

# Note: layouts
# A kernel reads each tensor as the flat array of its numel elements from ``data_ptr()``, which is
# right for any non-overlapping, dense tensor (contiguous, channels_last, a permuted view, any
# storage offset) as long as the tensors at one position of the lists (grad, param, state, out)
# order their elements alike; the C++ check (csrc/multi_tensor/checks.h) refuses anything else.
# torch.optim creates state with the param's strides (``zeros_like``, preserve_format), as the
# optimizers here do, and AccumulateGrad gives grads the param's strides, so in practice every
# position already qualifies and the lists go to the kernel as they are. Otherwise
# ``dense_temporaries`` makes it so, position by position: the param (``param_slot``) sets the
# layout (a param that is not dense, e.g. ``base[:, ::2]``, is replaced by a dense copy laid out as
# ``empty_like`` lays it out, which is also the layout of state created for it), and every other
# tensor laid out differently (a grad with other strides, state loaded from a checkpoint of another
# layout) is copied into a temporary of that layout. After the kernel, the temporaries of the slots
# the kernel writes are copied back. Alignment needs nothing here: the CPU loops take any address,
# and the CUDA traversal takes its 16-byte vector path only where the slots' addresses allow it
# (csrc/multi_tensor/cuda_elementwise.cuh).

_DTYPE = operator.attrgetter("dtype")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def as_they_are(lists: TensorLists, mixed_dtypes: bool) -> bool:
    """True when the kernel takes ``lists`` unchanged, in one call: every tensor contiguous and,
    unless the kernel dispatches per tensor, one dtype per slot (the common case; C-level loops)."""
    try:
        if not all(all(map(_IS_CONTIGUOUS, lst)) for lst in lists):
            return False
        return mixed_dtypes or all(len(set(map(_DTYPE, lst))) == 1 for lst in lists)
    except (TypeError, AttributeError):  # a None entry: a position without an out slot
        return False


def is_dense(t: Tensor) -> bool:
    """ATen's is_non_overlapping_and_dense (not bound in Python): the dims of size > 1, in stride
    order, tile the storage without gaps or overlap."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(t: Tensor, ref: Tensor) -> bool:
    """Whether ``t`` orders its elements as the dense ``ref`` does (as checks.h's same_layout)."""
    if t.is_contiguous() and ref.is_contiguous():
        return True
    if t.shape != ref.shape:
        return False
    return all(a == b for a, b, n in zip(t.stride(), ref.stride(), t.shape) if n != 1)


def dense_temporaries(
    name: str, lists: list[list[Tensor]], param_slot: int, writes: Sequence[int]
) -> tuple[list[list[Tensor]], list[tuple[Tensor, Tensor]]]:
    """``lists`` with every position readable as flat storage, and the (tensor, temporary) pairs
    to copy back after the kernel. See Note: layouts."""
    out = [list(lst) for lst in lists]
    temps: dict[int, Tensor] = {}  # by id: a tensor in several slots gets one temporary
    back: dict[int, tuple[Tensor, Tensor]] = {}
    for i in range(len(lists[0])):
        param = lists[param_slot][i]
        ref = param if is_dense(param) else None
        for k in [param_slot] + [k for k in range(len(lists)) if k != param_slot]:
            t = lists[k][i]
            if t is None or (ref is not None and same_layout(t, ref)):
                continue
            if t.device != param.device or t.numel() != param.numel():
                raise RuntimeError(
                    f"{name}: tensor {i} of list {k} ({t.numel()} elements on {t.device}) does "
                    f"not match tensor {i} of list {param_slot} ({param.numel()} elements on "
                    f"{param.device}): expected all tensors to be on the same device, with one "
                    "numel per position"
                )
            temp = temps.get(id(t))
            if temp is None:
                like = param if ref is None else ref
                temp = torch.empty_like(like, dtype=t.dtype)  # like's strides where it is dense
                temp.copy_(t if t.shape == param.shape else t.reshape(param.shape))
                temps[id(t)] = temp
            if ref is None:
                ref = temp
            out[k][i] = temp
            if k in writes:
                if torch._debug_has_internal_overlap(t) == 1:
                    raise RuntimeError(
                        f"{name}: tensor {i} of list {k} (shape {tuple(t.shape)}, strides "
                        f"{t.stride()}) has elements that share memory (an expanded view?), so it "
                        "cannot be updated in place; clone() it first"
                    )
                back[id(t)] = (t, temp)
    return out, list(back.values())


def signature_groups(lists: TensorLists) -> list[tuple[list[int], list[int]]]:
    """(positions, slots present) per dtype signature of ``lists``, in first-seen order.

    A None entry (only in the last slot, the out) leaves that slot out of its positions' call.
    """
    groups: dict[tuple[torch.dtype | None, ...], list[int]] = {}
    for i in range(len(lists[0])):
        key = tuple(None if lst[i] is None else lst[i].dtype for lst in lists)
        groups.setdefault(key, []).append(i)
    out = []
    for key, idx in groups.items():
        if None in key[:-1]:
            raise ValueError("only the last tensor list (the out slot) may have None entries")
        out.append((idx, [k for k, dtype in enumerate(key) if dtype is not None]))
    return out


def fits_as_is(lists: TensorLists) -> bool:
    """Whether every kernel call over (subsets of the slots of) ``lists`` can take them as they
    are: plain tensors, all contiguous, one dtype per slot. See Note: lists passed as they are."""
    return as_they_are(lists, mixed_dtypes=False) and not any(map(any_dtensor, lists))
