"""The one dispatch point between Python and the compiled kernels (``shardopt._C``).

Every optimizer calls the kernels through this module. It hands the kernels DTensors' local shards
(shardopt/optimizers/dtensor.py), checks that the tensors of one call share a device, groups tensor
lists by their dtype signature (one kernel launch per group) and picks the CPU or CUDA backend.
There is no silent Python fallback: a device without compiled kernels is an error that says how
to build them.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from shardopt import _build

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


def _signature_groups(lists: TensorLists) -> list[list[int]]:
    """Indices of tensor positions grouped by (dtype of each slot), in first-seen order."""
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for i in range(len(lists[0])):
        groups.setdefault(tuple(lst[i].dtype for lst in lists), []).append(i)
    return list(groups.values())


def _call(
    name: str,
    lists: TensorLists,
    *args,
    per_tensor: Sequence[Tensor] = (),
    **kwargs,
) -> list[tuple[list[int], Any]]:
    """Runs kernel ``name`` once per dtype group of ``lists``.

    ``per_tensor`` vectors (one entry per tensor position) are sliced to each group. Returns each
    group's tensor positions with the kernel's result for them.
    """
    from shardopt.optimizers.dtensor import local_lists

    lists = local_lists([lst for lst in lists if lst is not None])
    if not lists or not lists[0]:
        return []
    device = common_device([t for lst in lists for t in lst], "params and grads")
    kernel = getattr(_backend(device), name)
    if device.type == "cuda":
        per_tensor = [v.float() for v in per_tensor]
    groups = _signature_groups(lists)
    if len(groups) == 1:
        return [(groups[0], kernel(lists, *per_tensor, *args, **kwargs))]
    results = []
    for idx in groups:
        sub = [[lst[i] for i in idx] for lst in lists]
        index = torch.tensor(idx, device=per_tensor[0].device) if per_tensor else None
        vecs = [v.index_select(0, index) for v in per_tensor]
        results.append((idx, kernel(sub, *vecs, *args, **kwargs)))
    return results


def _per_tensor_results(
    results: list[tuple[list[int], tuple[Tensor, ...]]], n: int
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
            full.index_copy_(0, torch.tensor(idx, device=full.device), v.to(dtype))
        out.append(full)
    return tuple(out)


def adam(lists: TensorLists, **kwargs) -> None:
    """Adam/AdamW over [grad, param, exp_avg, exp_avg_sq(, out)]; see csrc/kernels.h."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::adam
        from shardopt import _custom_ops

        return _custom_ops.adam(lists, **kwargs)
    _call("adam", lists, **kwargs)


def sgd(lists: TensorLists, **kwargs) -> None:
    """SGD over [grad, param, momentum_buffer(, out)]; see csrc/kernels.h."""
    if torch.compiler.is_compiling():  # traced as the custom op shardopt::sgd
        from shardopt import _custom_ops

        return _custom_ops.sgd(lists, **kwargs)
    _call("sgd", lists, **kwargs)


def adagrad(lists: TensorLists, **kwargs) -> None:
    """Adagrad over [grad, param, sum(, out)]; see csrc/kernels.h."""
    _call("adagrad", lists, **kwargs)


def lamb_stage1(lists: TensorLists, **kwargs) -> tuple[Tensor, Tensor]:
    """LAMB moments over [grad, param, exp_avg, exp_avg_sq]; see csrc/kernels.h.

    Returns per-tensor sums of squares ``(w_sq, u_sq)`` of the params (before the update) and of
    the update terms, in the order of ``lists``, on the tensors' device: fp32 (fp64 on CPU when
    every param is fp64); zeros for a skipped step.
    """
    results = _call("lamb_stage1", lists, **kwargs)
    if not results:
        empty = torch.zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    w_sq, u_sq = _per_tensor_results(results, len(lists[0]))
    return w_sq, u_sq


def lamb_stage2(lists: TensorLists, w_norm: Tensor, u_norm: Tensor, **kwargs) -> None:
    """LAMB trust-ratio apply over [param, exp_avg, exp_avg_sq(, out)] with per-tensor norms."""
    _call("lamb_stage2", lists, per_tensor=(w_norm, u_norm), **kwargs)


def novograd(lists: TensorLists, v_norm: Tensor, **kwargs) -> None:
    """NovoGrad over [grad, param, exp_avg(, out)] with the per-tensor second moment."""
    _call("novograd", lists, per_tensor=(v_norm,), **kwargs)


def norm(tensors: Sequence[Tensor], max_norm: bool = False) -> tuple[Tensor, Tensor]:
    """Deterministic (total, per_tensor): sums of squares, or max |x| when ``max_norm``.

    fp32 results (fp64 when every input is fp64) on the tensors' device; empty input gives zeros.
    """
    from shardopt.optimizers.dtensor import local_lists

    (tensors,) = local_lists([tensors])
    if not tensors:
        z = torch.zeros((), dtype=torch.float32)
        return z, torch.zeros(0, dtype=torch.float32)
    device = common_device(tensors)
    return _backend(device).norm(tensors, max_norm)


def scale(
    src: Sequence[Tensor],
    dst: Sequence[Tensor],
    found_inf: Tensor,
    scale: float = 1.0,
    scale_t: Tensor | None = None,
) -> None:
    """dst = src * scale (``scale_t`` if given); sets ``found_inf`` to 1 on any inf/nan in src."""
    if not src:
        return
    from shardopt.optimizers.dtensor import local_lists

    src, dst = local_lists([src, dst])
    device = common_device(src + dst + [found_inf])
    _backend(device).scale([src, dst], scale, scale_t, found_inf)
