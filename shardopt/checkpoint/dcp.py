"""torch.distributed.checkpoint (DCP) interop: the optimizer's state as ShardedTensors.

Every state tensor of a param (and its fp32 master) becomes one 1-D ShardedTensor over the
flattened param, whose local shards are this rank's fragments: views of the flat shard buffers,
so ``dcp.save`` reads them and ``dcp.load`` writes into them in place. DCP's planner reshards
between any world sizes and bucket sizes.

    sd = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}
    dcp.save(sd, checkpoint_id=path)
    ...
    sd = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"]); optimizer.load_sharded_state_dict(sd["optim"])
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

from shardopt.zero.engine import DistributedOptimizer


def _groups(optimizer: DistributedOptimizer) -> list[dict[str, Any]]:
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        entry = {k: v for k, v in g.items() if k in optimizer.defaults}
        entry["step"] = int(g["step"].item())
        extra = optimizer._extra_group_state(gi)
        entry.update({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in extra.items()})
        out.append(entry)
    return out


def sharded_state_dict(optimizer: DistributedOptimizer) -> dict[str, Any]:
    """The optimizer state for ``torch.distributed.checkpoint`` (collective).

    ``{"state": {param index: {name: ShardedTensor}}, "param_groups": JSON text}``; the shards
    are views of the optimizer's buffers.
    """
    if optimizer.redundant_process_group is not None:
        raise RuntimeError(
            "sharded_state_dict() does not support a redundant_process_group (each replica would "
            "write the same shards); use shardopt.checkpoint.save"
        )
    optimizer.wait_param_sync()
    rank, group = optimizer.rank, optimizer.process_group
    state: dict[str, dict[str, Any]] = {}
    for key in optimizer.keys:
        buf = key.buffers
        named = dict(optimizer._shard_tensors(key))
        named["master_param"] = buf.master
        device = buf.master.device
        placement = f"rank:{rank}/{device.type}" + (
            f":{device.index}" if device.index is not None else ""
        )
        for i in key.layout.params:
            numel = optimizer.params[i].numel()
            frags = [f for f in buf.fragments if f.param == i]
            entry = {}
            for name, shard in named.items():
                local = [
                    Shard(
                        buf.fragment(shard, f),
                        ShardMetadata([f.param_range.start], [f.param_range.numel], placement),
                    )
                    for f in frags
                ]
                entry[name] = init_from_local_shards(local, [numel], process_group=group)
            state[str(optimizer.all_index[i])] = entry
    # param groups travel as one JSON string: DCP keeps plain objects whole, not nested lists
    return {"state": state, "param_groups": json.dumps(_groups(optimizer))}


@torch.no_grad()
def load_sharded_state_dict(optimizer: DistributedOptimizer, sd: dict[str, Any]) -> None:
    """Finishes a DCP load into ``sharded_state_dict()``'s structure (collective).

    The state tensors were already written in place by ``dcp.load``; this restores the
    hyperparameters and steps and writes the masters back into the params.
    """
    groups = sd["param_groups"]
    if isinstance(groups, str):
        groups = json.loads(groups)
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the loaded state has {len(groups)} param groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    optimizer._restore_groups(groups)
    optimizer._publish_masters()
