"""Process groups for HSDP: shard the optimizer within a node, replicate it across nodes.

``hsdp_groups()`` cuts the world into blocks of ``shard_size`` consecutive ranks. A rank's
``process_group`` is its block (the optimizer state is sharded over it; under torchrun a block is
one node, whose ranks are consecutive) and its ``redundant_process_group`` is the ranks holding
the same shard in the other blocks (the grad shard is all-reduced over it)::

    world 8, shard_size 4:  process groups   [0 1 2 3] [4 5 6 7]
                            redundant groups [0 4] [1 5] [2 6] [3 7]

Every rank must call it, in the same order relative to its other ``new_group`` calls: every rank
creates every group (``torch.distributed.new_subgroups_by_enumeration``), as torch requires.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch.distributed as dist

from shardopt.zero import comm


class HSDPGroups(NamedTuple):
    """The two sharding arguments of a ``DistributedFused*`` optimizer.

    ``DistributedFusedAdam(params, **hsdp_groups()._asdict())`` passes both.
    """

    process_group: comm.ProcessGroup
    redundant_process_group: comm.ProcessGroup | None  # None when there is one replica


def _local_request(shard_size: int | None) -> tuple[int | None, str | None, int | None]:
    """This rank's (shard size, problem, node rank) before any rank agrees."""
    group_rank = os.environ.get("GROUP_RANK")
    node = int(group_rank) if group_rank is not None and group_rank.isdigit() else None
    if shard_size is not None:
        return shard_size, None, node
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or not local.isdigit() or int(local) < 1:
        problem = (
            f"shard_size=None takes the shard size from LOCAL_WORLD_SIZE (torchrun's processes "
            f"per node), which is {local!r}; pass shard_size or launch with torchrun"
        )
        return None, problem, node
    return int(local), None, node


def hsdp_groups(shard_size: int | None = None) -> HSDPGroups:
    """Shard groups of ``shard_size`` consecutive ranks and the replica groups across them.

    Args:
        shard_size: ranks per shard group; must divide the world size. None: the
            ``LOCAL_WORLD_SIZE`` environment variable (torchrun's processes per node), so the
            optimizer shards within a node and replicates across nodes.

    Returns:
        ``HSDPGroups(process_group, redundant_process_group)`` for this rank; the redundant group
        is None when ``shard_size`` equals the world size (one replica: plain ZeRO).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: ``shard_size`` is not an int.
        ValueError: on every rank, when a rank has no shard size (no ``LOCAL_WORLD_SIZE``), the
            ranks disagree on it, it does not divide the world size, or (under torchrun) a shard
            group would span two nodes.

    Collective over the default group: every rank must call it.
    """
    comm.require_initialized("hsdp_groups")
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int)):
        raise TypeError(f"hsdp_groups: shard_size must be an int or None, got {shard_size!r}")
    if shard_size is not None and shard_size < 1:
        raise ValueError(f"hsdp_groups: shard_size must be >= 1, got {shard_size}")
    world = comm.world_size(None)
    # Agree first, so a bad layout raises the same error on every rank instead of a hang.
    requests = comm.all_gather_object(_local_request(shard_size), None)
    for r, (_, problem, _) in enumerate(requests):
        if problem is not None:
            raise ValueError(f"hsdp_groups: rank {r}: {problem}")
    sizes = sorted({size for size, _, _ in requests})
    if len(sizes) > 1:
        per_rank = ", ".join(f"rank {r}: {s}" for r, (s, _, _) in enumerate(requests))
        raise ValueError(
            f"hsdp_groups: the ranks disagree on the shard size ({per_rank}); nodes with "
            "different process counts need an explicit shard_size that divides every node"
        )
    size = sizes[0]
    if world % size:
        raise ValueError(
            f"hsdp_groups: shard_size {size} does not divide the world size {world}: every shard "
            f"group must have the same number of ranks (use a divisor of {world})"
        )
    nodes = [node for _, _, node in requests]
    if shard_size is None and None not in nodes:
        strays = [r for r, node in enumerate(nodes) if r // size != node]
        if strays:
            raise ValueError(
                f"hsdp_groups: ranks {strays} are not on node rank // LOCAL_WORLD_SIZE "
                f"(GROUP_RANK per rank: {nodes}): a shard group would span two nodes"
            )
    shard_lists = [list(range(start, start + size)) for start in range(0, world, size)]
    replica_lists = [list(range(offset, world, size)) for offset in range(size)]
    shard_group, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replica_group = None
    if len(replica_lists[0]) > 1:
        replica_group, _ = dist.new_subgroups_by_enumeration(replica_lists)
    return HSDPGroups(shard_group, replica_group)
