"""How a step count and an lr reach a kernel: a host number, or a device tensor read there.

Every kernel takes ``step``/``lr`` as host numbers and optional ``step_t``/``lr_t`` device tensors
that override them. A tensor step (capturable single-process steps, every ZeRO step) or a tensor
lr is handed over as the 1-element fp32 tensor on the update's device, with the host number 0: no
host sync, nothing baked into a CUDA graph, and under torch.compile no recompile when a scheduler
writes a new value into the tensor. The bias corrections are computed from that step inside the
kernels (``set_step`` in each ``csrc/optim/<name>_math.h``).
"""

from __future__ import annotations

from typing import Any

import torch


def device_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """lr as the kernels' 1-element fp32 ``lr_t`` on ``device``; a tensor lr already there is a
    view, so writing into it (a scheduler, a captured step) changes what the kernels read."""
    lr_t = lr if torch.is_tensor(lr) else torch.tensor(float(lr))
    return device_scalar(lr_t, device)


def device_scalar(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a 1-element fp32 tensor on ``device``: ``t`` itself when it is one already (no
    torch op: each releases and retakes the GIL, see Note: views kept for the update thread in
    shardopt/zero/flat_buffer.py), else a view or copy."""
    if t.shape == (1,) and t.dtype == torch.float32 and t.device == device:
        return t
    return t.to(device=device, dtype=torch.float32).reshape(1)


def lr_args(lr: float | torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The lr arguments of a kernel call: ``lr_t`` on ``device`` for a tensor lr, else the float."""
    if torch.is_tensor(lr):
        return {"lr": 0.0, "lr_t": device_lr(lr, device)}
    return {"lr": float(lr)}


def step_args(step: int | torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The step arguments of a kernel call: ``step_t`` (fp32, on ``device``) for a tensor step,
    else the host int."""
    if torch.is_tensor(step):
        return {"step": 0, "step_t": device_scalar(step, device)}
    return {"step": int(step)}


def update_device(params: list) -> torch.device:
    """Where an update of ``params`` runs (their device; the device scalars go there)."""
    return params[0].device
