"""Sharded, reshardable, crash-safe checkpoints of the DistributedFused optimizers.

    shardopt.checkpoint.save("ckpt/step-1000", optimizer, model)   # collective
    shardopt.checkpoint.load("ckpt/step-1000", optimizer, model)   # any world size / bucket size

Offline: ``python -m shardopt.checkpoint consolidate CKPT OUT.pt`` (a plain torch.optim state dict)
and ``python -m shardopt.checkpoint inspect CKPT``. A plain torch.optim state dict imports into a
DistributedFused optimizer with ``optimizer.load_state_dict(sd)``. See docs/checkpointing.md.
"""

from shardopt.checkpoint.consolidate import consolidate, consolidated_state_dict, inspect
from shardopt.checkpoint.format import CheckpointError
from shardopt.checkpoint.sharded import load, save

__all__ = ["CheckpointError", "consolidate", "consolidated_state_dict", "inspect", "load", "save"]
