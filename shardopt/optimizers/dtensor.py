"""DTensor params (FSDP2 ``fully_shard``, tensor parallel) in the single-process optimizers.

The kernels only see plain tensors: ``shardopt.kernels`` passes every tensor through :func:`local`
(a DTensor's local shard, a view of its storage, so in-place updates land in the param;
``shardopt.kernels.dtensor``, re-exported here). State is created with ``zeros_like(param)`` and so
is a DTensor with the param's placements, as torch.optim's is (its state dict holds DTensors, which
``torch.distributed.checkpoint`` saves and reshards). Elementwise rules (Adam, SGD, Adagrad) need
nothing else. Per-tensor reductions (LAMB's global grad norm and trust-ratio norms, NovoGrad's grad
norms) are taken on the local shards and completed by :func:`reduce_per_tensor`, an all-reduce over
the mesh dimensions each tensor is sharded on, so the result equals the unsharded optimizer's. Any
other tensor subclass is rejected by :func:`check_param_types` (the kernels read raw storage, which
a wrapper subclass does not have).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardopt.kernels.dtensor import any_dtensor, is_dtensor, local, local_lists

__all__ = [
    "any_dtensor",
    "check_param_types",
    "is_dtensor",
    "local",
    "local_lists",
    "reduce_per_tensor",
]


def check_param_types(params: Sequence[torch.Tensor], owner: str, first_index: int = 0) -> None:
    """Plain tensors, ``nn.Parameter`` and DTensors only: a TypeError names any other subclass."""
    for i, p in enumerate(params, first_index):
        if type(p) in (torch.Tensor, torch.nn.Parameter) or is_dtensor(p):
            continue
        raise TypeError(
            f"{owner} supports plain tensors and DTensors (FSDP2, tensor parallel); param {i} is a "
            f"{type(p).__module__}.{type(p).__qualname__}, a tensor subclass its fused kernels "
            "cannot update"
        )


def reduce_per_tensor(
    values: torch.Tensor, tensors: Sequence[torch.Tensor], op: str = "sum"
) -> torch.Tensor:
    """Completes per-tensor reductions taken on local shards.

    ``values[i]`` is a sum of squares (``op="sum"``) or a max |x| (``op="max"``) over the local
    shard of ``tensors[i]``; each entry of a DTensor is all-reduced over the process groups of the
    mesh dimensions it is sharded on (not over those it is replicated on). Collective on those
    groups: every rank must call it with the same tensors in the same order (as the optimizer
    does: SPMD). Plain tensors' entries are returned unchanged.
    """
    import torch.distributed as dist

    plans: dict[tuple, tuple] = {}
    for i, t in enumerate(tensors):
        if not is_dtensor(t):
            continue
        if any(p.is_partial() for p in t.placements):
            raise TypeError(
                f"tensor {i} is a DTensor with a Partial placement {t.placements}; redistribute "
                "it (Shard or Replicate) before the optimizer step"
            )
        dims = tuple(d for d, p in enumerate(t.placements) if p.is_shard())
        if dims:
            key = (id(t.device_mesh), dims)
            plans.setdefault(key, (t.device_mesh, dims, []))[2].append(i)
    if not plans:
        return values
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    out = values.clone()
    for mesh, dims, idx in plans.values():
        index = torch.tensor(idx, device=out.device)
        part = out.index_select(0, index)
        for d in dims:
            dist.all_reduce(part, op=reduce_op, group=mesh.get_group(d))
        out.index_copy_(0, index, part)
    return out
