"""The one dispatch point between Python and the compiled kernels (``shardopt._C``).

Every optimizer calls the kernels through this module, and ``_call`` is the one place where tensor
lists are fitted to them: it hands the kernels DTensors' local shards
(shardopt/optimizers/dtensor.py), splits lists that mix dtypes into one call per dtype signature,
passes tensors the kernels cannot read as flat storage through temporaries (see Note: layouts) and
picks the CPU or CUDA backend of the lists' device (the C++ checks refuse a tensor on another one).
There is no silent Python fallback: a device without compiled kernels is an error that says how
to build them.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from shardopt import _build
from shardopt._layouts import (
    _as_they_are,
    _layouts,
    _signature_groups,
    fits_as_is,
    is_dense,
    same_layout,
)

__all__ = ["fits_as_is", "is_dense", "same_layout"]

Tensor = torch.Tensor
TensorLists = Sequence[Sequence[Tensor]]

_C: ModuleType | None = None
_CPU: ModuleType | None = None


def extension() -> ModuleType:
    """The loaded ``shardopt._C`` (built just in time on first use if not installed)."""
    global _C
    if _C is None:
        _C = _build.load_extension()
    return _C


def cpu_extension() -> ModuleType:
    """The module whose ``cpu`` kernels serve CPU tensors: the ISA build for this CPU.

    See Note: CPU capability dispatch (shardopt/_build.py).
    """
    global _CPU
    if _CPU is None:
        _CPU = _build.load_cpu_extension(extension())
    return _CPU


def cuda_available() -> bool:
    """True when the loaded extension was compiled with CUDA kernels."""
    return bool(extension().has_cuda)


def chunk_size(device: torch.device | str) -> int:
    """Elements per (tensor, chunk) work item of the backend that serves ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(extension().cuda_chunk_size)
    return int(cpu_extension().cpu_chunk_size)


def _backend(device: torch.device) -> ModuleType:
    if device.type == "cpu":
        return cpu_extension().cpu
    ext = extension()
    if device.type == "cuda":
        if not ext.has_cuda:
            raise RuntimeError(
                "shardopt was built without CUDA kernels, so it cannot update CUDA tensors. "
                "Rebuild with a CUDA-enabled torch and nvcc on PATH (or CUDA_HOME set): "
                "`pip install --no-build-isolation .` or remove the JIT cache "
                "(~/.cache/shardopt) and import again; SHARDOPT_BUILD_CUDA=1 makes a missing "
                "toolkit an error."
            )
        return ext.cuda
    raise RuntimeError(f"shardopt has no kernels for {device.type} tensors (cpu and cuda only)")


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


# Lists the kernels cannot read as they are go through dense temporaries: see Note: layouts in
# shardopt/_layouts.py (``fits_as_is``, ``is_dense`` and ``same_layout`` are re-exported here).


def as_is_kwargs(as_is: bool) -> dict[str, bool]:
    """``{"as_is": True}`` or nothing: the keyword reaches ``_call`` only when set, so the
    torch.compile route of the public wrappers never sees it."""
    return {"as_is": True} if as_is else {}


# Note: lists passed as they are
# A single-process optimizer that has seen its lists fit the kernels (``fits_as_is``: plain
# tensors, all contiguous, one dtype per slot) passes ``as_is=True`` on later steps, and ``_call``
# hands the lists to the kernel without looking at any tensor (shardopt/optimizers/step_plan.py,
# Note: step plans). That is safe because the kernels check every tensor before they read or
# write anything and name themselves at the start of every message (csrc/multi_tensor/checks.h):
# if something changed since (a grad with other strides, a param re-bound to another layout or
# dtype), the kernel refuses, nothing has been written, and ``_call`` fits the same lists as it
# always does, which either takes them through temporaries and signature splits or raises the
# error it would have raised anyway. A list the kernel accepts is one the fitting would have
# passed unchanged in one call, so both routes give the same bits.


def _refused(name: str, exc: Exception) -> bool:
    """Whether ``exc`` is kernel ``name`` refusing its arguments (raised before any write)."""
    return str(exc).startswith(name)


def _call(
    name: str,
    lists: TensorLists,
    *args,
    per_tensor: Sequence[Tensor | None] = (),
    per_tensor_writes: Sequence[int] = (),
    param_slot: int = 1,
    writes: Sequence[int] = (),
    mixed_dtypes: bool = False,
    as_is: bool = False,
    **kwargs,
) -> list[tuple[Sequence[int], Any]]:
    """Runs kernel ``name`` over ``lists``: the one place where lists are fitted to the kernels.

    Tensors laid out so that the kernel cannot read them flat are replaced by temporaries (see
    Note: layouts; ``param_slot`` is the slot that sets the layout, ``writes`` the slots copied
    back), and lists that mix dtypes within a slot are split into one call per dtype signature
    (unless ``mixed_dtypes``: the kernel dispatches per tensor). ``per_tensor`` vectors (one entry
    per position, or None) are sliced to each call; those at ``per_tensor_writes``, which the
    kernel writes in place, are written back wherever a call got a slice or an fp32 copy.
    ``as_is`` tries the lists unchanged first (see Note: lists passed as they are). Returns each
    call's positions with its result.
    """
    from shardopt.optimizers.dtensor import local_lists

    lists = [lst for lst in lists if lst is not None]
    if not lists or not lists[0]:
        return []
    device = lists[0][0].device  # the kernel checks that every tensor is on it
    kernel = getattr(_backend(device), name)
    given = per_tensor
    if device.type == "cuda":  # the CUDA kernels read fp32 vectors in place
        per_tensor = [v if v is None or v.dtype == torch.float32 else v.float() for v in per_tensor]
    n = len(lists[0])
    if as_is:
        try:
            results = [(range(n), kernel(lists, *per_tensor, *args, **kwargs))]
            _write_back(given, per_tensor_writes, [(None, per_tensor)])
            return results
        except (RuntimeError, TypeError, ValueError) as exc:
            if not _refused(name, exc):
                raise
    lists = local_lists(lists)
    if _as_they_are(lists, mixed_dtypes):
        results = [(range(n), kernel(lists, *per_tensor, *args, **kwargs))]
        _write_back(given, per_tensor_writes, [(None, per_tensor)])
        return results
    lists, back = _layouts(name, lists, param_slot, writes)
    passed = []  # (index or None, the vectors a call got)
    if mixed_dtypes:
        results = [(range(n), kernel(lists, *per_tensor, *args, **kwargs))]
        passed.append((None, per_tensor))
    else:
        results = []
        for idx, slots in _signature_groups(lists):
            sub = [[lists[k][i] for i in idx] for k in slots]
            index = None
            if len(idx) < n and per_tensor:
                first = next(v for v in per_tensor if v is not None)
                index = torch.tensor(idx, device=first.device)
                vecs = [None if v is None else v.index_select(0, index) for v in per_tensor]
            else:
                vecs = list(per_tensor)
            results.append((idx, kernel(sub, *vecs, *args, **kwargs)))
            passed.append((index, vecs))
    with torch.no_grad():
        for t, temp in back:
            t.copy_(temp)
    _write_back(given, per_tensor_writes, passed)
    return results


def _write_back(
    given: Sequence[Tensor | None],
    slots: Sequence[int],
    passed: list[tuple[Tensor | None, Sequence[Tensor | None]]],
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
    """Per-group result vectors of a ``_call`` assembled into full-length vectors (caller order)."""
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


def adam(lists: TensorLists, **kwargs) -> None:
    """Adam/AdamW over [grad, param, exp_avg, exp_avg_sq(, out)]; see csrc/kernels.h."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::adam
        from shardopt import _custom_ops

        return _custom_ops.adam(lists, **kwargs)
    _call("adam", lists, writes=(1, 2, 3, 4), **kwargs)


def sgd(lists: TensorLists, **kwargs) -> None:
    """SGD over [grad, param, momentum_buffer(, out)]; see csrc/kernels.h."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::sgd
        from shardopt import _custom_ops

        return _custom_ops.sgd(lists, **kwargs)
    _call("sgd", lists, writes=(1, 2, 3), **kwargs)


def adagrad(lists: TensorLists, **kwargs) -> None:
    """Adagrad over [grad, param, sum(, out)]; see csrc/kernels.h."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::adagrad
        from shardopt import _custom_ops

        return _custom_ops.adagrad(lists, **kwargs)
    _call("adagrad", lists, writes=(1, 2, 3), **kwargs)


def lamb_stage1(lists: TensorLists, **kwargs) -> tuple[Tensor, Tensor]:
    """LAMB moments over [grad, param, exp_avg, exp_avg_sq]; see csrc/kernels.h.

    Returns per-tensor sums of squares ``(w_sq, u_sq)`` of the params (before the update) and of
    the update terms, in the order of ``lists``, on the tensors' device: fp32 (fp64 on CPU when
    every param is fp64); zeros for a skipped step.
    """
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::lamb_stage1
        from shardopt import _custom_ops

        return _custom_ops.lamb_stage1(lists, **kwargs)
    results = _call("lamb_stage1", lists, writes=(2, 3), **kwargs)
    if not results:
        empty = torch.zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    w_sq, u_sq = _per_tensor_results(results, len(lists[0]))
    return w_sq, u_sq


def lamb_stage2(lists: TensorLists, w_norm: Tensor, u_norm: Tensor, **kwargs) -> None:
    """LAMB trust-ratio apply over [param, exp_avg, exp_avg_sq(, out)] with per-tensor norms."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::lamb_stage2
        from shardopt import _custom_ops

        return _custom_ops.lamb_stage2(lists, w_norm, u_norm, **kwargs)
    _call(
        "lamb_stage2",
        lists,
        per_tensor=(w_norm, u_norm),
        param_slot=0,
        writes=(0, 3),
        **kwargs,
    )


def novograd(lists: TensorLists, v_norm: Tensor, **kwargs) -> None:
    """NovoGrad over [grad, param, exp_avg(, out)] with the per-tensor second moment."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::novograd
        from shardopt import _custom_ops

        return _custom_ops.novograd(lists, v_norm, **kwargs)
    _call("novograd", lists, per_tensor=(v_norm,), writes=(1, 2, 3), **kwargs)


def novograd_step(lists: TensorLists, v: Tensor, fresh: Tensor | None = None, **kwargs) -> None:
    """NovoGrad's whole step over [grad, param, exp_avg(, out)] (see csrc/kernels.h): the
    per-tensor grad norms (``norm_type`` 2 or 0), the per-tensor second moments ``v`` blended with
    them in place (``fresh``: nonzero where a param has its first update; ``init_zero``), then the
    update with the blended ``v``. Nothing is written unless every argument passes the checks."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::novograd_step
        from shardopt import _custom_ops

        return _custom_ops.novograd_step(lists, v, fresh, **kwargs)
    _call(
        "novograd_step",
        lists,
        per_tensor=(v, fresh),
        per_tensor_writes=(0,),
        writes=(1, 2, 3),
        **kwargs,
    )


def norm(
    tensors: Sequence[Tensor], max_norm: bool = False, as_is: bool = False
) -> tuple[Tensor, Tensor]:
    """Deterministic (total, per_tensor): sums of squares, or max |x| when ``max_norm``.

    fp32 results (fp64 when every input is fp64) on the tensors' device; empty input gives zeros.
    The tensors may mix dtypes and layouts (the kernel dispatches per tensor; see Note: layouts).
    ``as_is`` tries them unchanged first (see Note: lists passed as they are).
    """
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::norm
        from shardopt import _custom_ops

        return _custom_ops.norm(tensors, max_norm)
    from shardopt.optimizers.dtensor import local_lists

    if as_is and tensors:
        try:
            return _backend(tensors[0].device).norm(tensors, max_norm)
        except (RuntimeError, TypeError, ValueError) as exc:
            if not _refused("norm", exc):
                raise
    lists = local_lists([tensors])
    if not lists[0]:
        z = torch.zeros((), dtype=torch.float32)
        return z, torch.zeros(0, dtype=torch.float32)
    if not _as_they_are(lists, mixed_dtypes=True):
        lists, _ = _layouts("norm", lists, 0, ())
    return _backend(lists[0][0].device).norm(lists[0], max_norm)


def scale(
    src: Sequence[Tensor],
    dst: Sequence[Tensor],
    found_inf: Tensor,
    scale: float = 1.0,
    scale_t: Tensor | None = None,
    as_is: bool = False,
) -> None:
    """dst = src * scale (``scale_t`` if given); sets ``found_inf`` to 1 on any inf/nan in src.

    ``src`` and ``dst`` may mix dtypes and layouts (the kernels dispatch per dtype).
    """
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::scale
        from shardopt import _custom_ops

        return _custom_ops.scale(src, dst, found_inf, scale, scale_t)
    _call(
        "scale",
        [src, dst],
        scale,
        scale_t,
        found_inf,
        writes=(1,),
        mixed_dtypes=True,
        **as_is_kwargs(as_is),
    )
