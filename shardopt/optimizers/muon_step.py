"""The Muon update over a list of params, one function for ``FusedMuon`` (all of a group's
params) and ``DistributedFusedMuon`` (the params this rank owns): the Newton-Schulz stacks of a
group (``shape_batches``), the step (``muon_step``: the fused momentum kernel writes each
Newton-Schulz input into its stack, one chain per shape (small stacks at once on side streams:
``algorithms.muon_streams``), the fused apply kernel decays and adds)
and torch.optim.Muon's state-dict form (``drop_muon_steps``). The algorithm itself is
shardopt/algorithms/muon.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardopt.algorithms import muon, muon_streams


@dataclasses.dataclass(frozen=True)
class Batch:
    """The matrices of one shape (``rows`` x ``cols``) of a group, stacked for one Newton-Schulz
    chain: ``direct`` params ``(index, offset, count)`` are whole views of the stack (their mix
    is written there by the momentum kernel); ``gathered`` row blocks ``(index, offset, count,
    row_start)`` of params split unevenly are copied in and out."""

    rows: int
    cols: int
    matrices: int
    direct: tuple[tuple[int, int, int], ...]
    gathered: tuple[tuple[int, int, int, int], ...]


def shape_batches(params: list, flatten: bool, ns_split: Any = None) -> tuple[Batch, ...]:
    """The stacks of a group's Newton-Schulz (see ``Batch``), in order of first appearance."""
    found: dict[tuple[int, int], tuple[list, list, list]] = {}
    for i, p in enumerate(params):
        count, rows, cols = muon.matrix_shape(p.shape, flatten)
        sizes = muon.split_rows(rows, ns_split)
        if len(set(sizes)) == 1:  # even blocks: a view of the param, (count * blocks, size, cols)
            size, blocks = sizes[0], len(sizes)
            total, direct, _ = found.setdefault((size, cols), ([0], [], []))
            direct.append((i, total[0], count * blocks))
            total[0] += count * blocks
            continue
        row = 0
        for size in sizes:
            total, _, gathered = found.setdefault((size, cols), ([0], [], []))
            gathered.append((i, total[0], count, row))
            total[0] += count
            row += size
    return tuple(
        Batch(rows, cols, total[0], tuple(direct), tuple(gathered))
        for (rows, cols), (total, direct, gathered) in found.items()
    )


def muon_step(
    group: dict,
    grads: list,
    params: list,
    outs: list | None,
    bufs: list,
    batches: tuple[Batch, ...],
    lr: Any,
    as_is: bool,
) -> None:
    """One Muon update of ``params`` (fp32 masters where kept, ``outs`` their 16-bit params):
    the fused momentum kernel writes each Newton-Schulz input into its stack, one chain per
    shape, the fused apply kernel decays and adds. See shardopt/algorithms/muon.py."""
    device, dtype = params[0].device, group["ns_dtype"]
    stacks = [
        torch.empty((b.matrices, b.rows, b.cols), dtype=dtype, device=device) for b in batches
    ]
    mixes: list = [None] * len(params)
    for b, stack in zip(batches, stacks):
        for i, offset, count in b.direct:
            mixes[i] = stack[offset : offset + count].view(params[i].shape)
    gathered = sorted({i for b in batches for i, *_ in b.gathered})
    for i in gathered:
        mixes[i] = torch.empty(params[i].shape, dtype=dtype, device=device)
    muon.momentum_and_mix(grads, bufs, mixes, group["momentum"], group["nesterov"], as_is=as_is)
    for b, stack in zip(batches, stacks):
        for i, offset, count, row in b.gathered:
            blocks = _row_blocks(mixes[i], group["flatten"], row, b.rows)
            stack[offset : offset + count].copy_(blocks)
    updates: list = [None] * len(params)
    orthos = muon_streams.orthogonalized(stacks, lambda stack: muon.orthogonalize(stack, group))
    for b, ortho in zip(batches, orthos):
        ratio = muon.lr_ratio(group["adjust_lr_fn"], b.rows, b.cols)
        for i, offset, count, row in b.gathered:  # each block with its own shape scale
            if updates[i] is None:
                updates[i] = torch.empty(params[i].shape, dtype=dtype, device=device)
            target = _row_blocks(updates[i], group["flatten"], row, b.rows)
            target.copy_(ortho[offset : offset + count]).mul_(ratio)
        if not b.direct:
            continue
        index = [i for i, _, _ in b.direct]
        pieces = [ortho[o : o + c].reshape(params[i].shape) for i, o, c in b.direct]
        muon.decay_and_apply(
            [params[i] for i in index], pieces, None if outs is None else [outs[i] for i in index],
            lr, group["weight_decay"], ratio, as_is=as_is,
        )  # fmt: skip
    if gathered:
        muon.decay_and_apply(
            [params[i] for i in gathered], [updates[i] for i in gathered],
            None if outs is None else [outs[i] for i in gathered],
            lr, group["weight_decay"], 1.0, as_is=as_is,
        )  # fmt: skip


def _row_blocks(t: torch.Tensor, flatten: bool, row: int, size: int) -> torch.Tensor:
    """Rows ``[row, row + size)`` of each logical matrix of ``t``: a (count, size, cols) view."""
    count, rows, cols = muon.matrix_shape(t.shape, flatten)
    return t.view(count, rows, cols)[:, row : row + size]


def drop_muon_steps(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The Muon groups of ``state_dict`` as torch.optim.Muon writes them: no ``step``."""
    for group in state_dict["param_groups"]:
        if group.get("use_muon", True):
            group.pop("step", None)
            for pid in group["params"]:
                state_dict["state"].get(pid, {}).pop("step", None)
    return state_dict
