"""The one dispatch point between Python and the compiled kernels: ``run`` calls kernel ``spec``
over tensor lists, fitted to it.

Fitting: DTensors become their local shards (``kernels.dtensor``), lists that mix dtypes are split
into one call per dtype signature (unless the kernel dispatches per tensor), tensors the kernels
cannot read as flat storage go through temporaries (Note: layouts in ``kernels.layouts``), and the
backend is the CPU or CUDA one of the lists' device (``loader.backend``; the C++ checks refuse a
tensor on another one). What to write back and which slot sets the layout come from the kernel's
spec (``kernels.specs``). Also here: the device checks the optimizers run on their params.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.kernels import layouts, loader
from shardopt.kernels.dtensor import local_lists
from shardopt.kernels.specs import KernelSpec

Tensor = torch.Tensor
TensorLists = Sequence[Sequence[Tensor]]
Vectors = Sequence[Tensor | None]


def common_device(tensors: Sequence[Tensor], what: str = "tensors") -> torch.device:
    """The single device of ``tensors``; a clear error when they are spread over several."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        first = tensors[0].device
        i, t = next((i, t) for i, t in enumerate(tensors) if t.device != first)
        raise RuntimeError(
            f"Expected all {what} to be on the same device: tensor {i} (shape "
            f"{tuple(t.shape)}) is on {t.device}, not on the same device as tensor 0 ({first}); "
            "use one optimizer per device"
        )
    return next(iter(devices)) if devices else torch.device("cpu")


def check_param_devices(params: Sequence[Tensor], owner: str, first_index: int = 0) -> torch.device:
    """The one device of ``params`` that have grads (torch keeps each grad on its param's).

    The error says "not on the same device" (torch's and Apex's wording) and names the param's
    index among all the optimizer's params (``first_index`` is that of ``params[0]``), its shape
    and both devices.
    """
    device = None
    first = None
    for i, p in enumerate(params, first_index):
        if p.grad is None:
            continue
        if device is None:
            device, first = p.device, i
        elif p.device != device:
            raise RuntimeError(
                f"{owner}: param {i} (shape {tuple(p.shape)}) is on {p.device}, not on the same "
                f"device as param {first} ({device}); all params of a param group must be on "
                "one device: use one optimizer (or param group) per device"
            )
    return device if device is not None else torch.device("cpu")


def as_is_kwargs(as_is: bool) -> dict[str, bool]:
    """``{"as_is": True}`` or nothing: the keyword reaches ``run`` only when set, so the
    torch.compile route of the public wrappers never sees it."""
    return {"as_is": True} if as_is else {}


# Note: lists passed as they are
# A single-process optimizer that has seen its lists fit the kernels (``fits_as_is``: plain
# tensors, all contiguous, one dtype per slot) passes ``as_is=True`` on later steps, and ``run``
# hands the lists to the kernel without looking at any tensor (shardopt/optimizers/step_plan.py,
# Note: step plans). That is safe because the kernels check every tensor before they read or
# write anything and name themselves at the start of every message (csrc/multi_tensor/checks.h):
# if something changed since (a grad with other strides, a param re-bound to another layout or
# dtype), the kernel refuses, nothing has been written, and ``run`` fits the same lists as it
# always does, which either takes them through temporaries and signature splits or raises the
# error it would have raised anyway. A list the kernel accepts is one the fitting would have
# passed unchanged in one call, so both routes give the same bits.


def _refused(name: str, exc: Exception) -> bool:
    """Whether ``exc`` is kernel ``name`` refusing its arguments (raised before any write)."""
    return str(exc).startswith(name)


def run(
    spec: KernelSpec,
    lists: TensorLists,
    vectors: Vectors,
    args: Sequence[Any],
    as_is: bool = False,
) -> tuple[Tensor, ...] | None:
    """Runs the kernel of ``spec`` over ``lists`` with its per-tensor ``vectors`` and ``args``
    (both in the C++ order, as ``spec.bind`` gives them): the one place where lists are fitted.

    ``as_is`` tries the lists unchanged first (see Note: lists passed as they are). Returns the
    kernel's results over all positions in the caller's order (``spec.returns``), or None.
    """
    lists = [lst for lst in lists if lst is not None]
    if not lists or not lists[0]:
        return spec.empty_results()
    kernel = getattr(loader.backend(lists[0][0].device), spec.name)  # checks every tensor's
    if not spec.fit:
        return _result(kernel(lists, *vectors, *args))

    def call(sub: list[list[Tensor]], vecs: Vectors) -> Any:
        return kernel(sub[0] if spec.flat else sub, *vecs, *args)

    given = list(vectors)
    if lists[0][0].device.type == "cuda":  # the CUDA kernels read fp32 vectors in place
        vectors = [v if v is None or v.dtype == torch.float32 else v.float() for v in vectors]
    n = len(lists[0])
    if as_is:
        try:
            result = call(lists, vectors)
            _write_back(given, spec.vector_writes, [(None, vectors)])
            return _result(result)
        except (RuntimeError, TypeError, ValueError) as exc:
            if not _refused(spec.name, exc):
                raise
    lists = local_lists(lists)
    if layouts.as_they_are(lists, spec.mixed_dtypes):
        result = call(lists, vectors)
        _write_back(given, spec.vector_writes, [(None, vectors)])
        return _result(result)
    lists, back = layouts.dense_temporaries(spec.name, lists, spec.param_slot, spec.writes)
    if spec.mixed_dtypes:
        results, passed = [(range(n), call(lists, vectors))], [(None, vectors)]
    else:
        results, passed = _by_signature(call, lists, vectors)
    with torch.no_grad():
        for t, temp in back:
            t.copy_(temp)
    _write_back(given, spec.vector_writes, passed)
    return _per_tensor_results(results, n) if spec.returns else None


def _by_signature(
    call: Callable[[list[list[Tensor]], Vectors], Any], lists: list[list[Tensor]], vectors: Vectors
) -> tuple[list[tuple[Sequence[int], Any]], list[tuple[Tensor | None, Vectors]]]:
    """One kernel call per dtype signature of ``lists``: each call's (positions, result), and
    (positions as an index tensor or None for all, the vectors it got)."""
    n = len(lists[0])
    results, passed = [], []
    for idx, slots in layouts.signature_groups(lists):
        sub = [[lists[k][i] for i in idx] for k in slots]
        index = None
        if len(idx) < n and vectors:
            first = next(v for v in vectors if v is not None)
            index = torch.tensor(idx, device=first.device)
            vecs = [None if v is None else v.index_select(0, index) for v in vectors]
        else:
            vecs = list(vectors)
        results.append((idx, call(sub, vecs)))
        passed.append((index, vecs))
    return results, passed


def _result(result: Any) -> tuple[Tensor, ...] | None:
    return None if result is None else tuple(result)


def _write_back(
    given: Vectors, slots: Sequence[int], passed: list[tuple[Tensor | None, Vectors]]
) -> None:
    """Per-tensor vectors a kernel wrote in place (``slots``): each call's slice (its positions
    ``index``, None: all of them) or fp32 copy goes back into the caller's vector."""
    for k in slots:
        for index, vecs in passed:
            if vecs[k] is given[k]:
                continue
            with torch.no_grad():
                if index is None:
                    given[k].copy_(vecs[k])
                else:
                    given[k].index_copy_(0, index, vecs[k].to(given[k].dtype))


def _per_tensor_results(
    results: list[tuple[Sequence[int], tuple[Tensor, ...]]], n: int
) -> tuple[Tensor, ...]:
    """Per-call result vectors assembled into full-length vectors (caller order), promoted."""
    if len(results) == 1:
        return tuple(results[0][1])
    out = []
    for k in range(len(results[0][1])):
        parts = [(idx, res[k]) for idx, res in results]
        dtype = parts[0][1].dtype
        for _, v in parts[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
        full = torch.zeros(n, dtype=dtype, device=parts[0][1].device)
        for idx, v in parts:
            full.index_copy_(0, torch.tensor(list(idx), device=full.device), v.to(dtype))
        out.append(full)
    return tuple(out)
