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

from shardopt.checkpoint import format as fmt


def sharded_state_dict(optimizer) -> dict[str, Any]:
    """The optimizer state for ``torch.distributed.checkpoint`` (collective).

    ``{"state": {param index: {name: ShardedTensor}}, "param_groups": JSON text}``; the shards
    are views of the optimizer's buffers (its ``shard_fragments()``).
    """
    if optimizer.redundant_process_group is not None:
        raise RuntimeError(
            "sharded_state_dict() does not support a redundant_process_group (each replica would "
            "write the same shards); use shardopt.checkpoint.save"
        )
    optimizer.wait_param_sync()
    rank, group = optimizer.rank, optimizer.process_group
    by_param: dict[int, list] = {}
    for frag in optimizer.shard_fragments():
        by_param.setdefault(frag.param, []).append(frag)
    # every rank must create the same ShardedTensors, also for params it holds no fragment of
    trainable = [i for i, p in enumerate(optimizer.all_params) if p.requires_grad]
    names = list(optimizer.state_names) + ["master_param"]
    state: dict[str, dict[str, Any]] = {}
    for i in trainable:
        numel = optimizer.all_params[i].numel()
        entry = {}
        for name in names:
            local = []
            for frag in by_param.get(i, []):
                view = frag.tensors[name]
                device = view.device
                placement = f"rank:{rank}/{device.type}" + (
                    f":{device.index}" if device.index is not None else ""
                )
                r = frag.param_range
                local.append(Shard(view, ShardMetadata([r.start], [r.numel], placement)))
            entry[name] = init_from_local_shards(local, [numel], process_group=group)
        state[str(i)] = entry
    # param groups travel as one JSON string: DCP keeps plain objects whole, not nested lists
    groups = fmt.encode_metadata(optimizer.export_param_groups(), "param_groups")
    return {"state": state, "param_groups": groups.decode()}


@torch.no_grad()
def load_sharded_state_dict(optimizer, sd: dict[str, Any]) -> None:
    """Finishes a DCP load into ``sharded_state_dict()``'s structure (collective).

    The state tensors were already written in place by ``dcp.load``; this restores the
    param groups and writes the masters back into the params.
    """
    groups = sd["param_groups"]
    if isinstance(groups, str):
        groups = json.loads(groups)
    optimizer.import_param_groups(groups)
    optimizer.publish_masters()
