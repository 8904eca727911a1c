"""DTensors at the kernel boundary: the kernels only see plain tensors, so every DTensor in a
kernel's lists is replaced by its local shard (``to_local()``, a view of its storage, so in-place
updates land in the DTensor). The optimizer side of DTensor support (which tensor types a
param may be, per-tensor reductions over the mesh) is ``shardopt.optimizers.dtensor``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch


def _dtensor_class() -> type | None:
    """DTensor, if ``torch.distributed.tensor`` was imported (else no DTensor can exist: it is
    not imported here, which keeps ``import shardopt`` light)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels update: a DTensor's local shard (a view of it), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def local_lists(lists: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """``lists`` with every DTensor replaced by its local shard (no-op without DTensors)."""
    cls = _dtensor_class()
    if cls is None:
        return [list(lst) for lst in lists]
    return [[t.to_local() if isinstance(t, cls) else t for t in lst] for lst in lists]


def any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    cls = _dtensor_class()
    return cls is not None and any(isinstance(t, cls) for t in tensors)
