"""Integrations with training stacks; each submodule imports its framework only when imported.

- (in ``shardopt.zero.torch_clip``, installed when the first distributed optimizer is built)
  ``torch.nn.utils.clip_grad_norm_`` on the params of a ``DistributedFused*`` optimizer routes to
  ``optimizer.clip_grad_norm``; ``clip_grad_value_`` on them raises.
- ``shardopt.integrations.accelerate``: ``patch(accelerator)``: no DDP wrapper for models whose
  params a ``DistributedFused*`` optimizer holds, ``accelerator.no_sync``/``accumulate`` and
  ``clip_grad_norm_`` routed to the optimizer.
- ``shardopt.integrations.transformers``: ``Trainer``, the HF Trainer with that accelerator and
  its checkpoints' optimizer state dict taken on every rank.
- ``shardopt.integrations.lightning``: ``ShardoptStrategy``, Lightning's DDP strategy without the
  DDP wrapper (accumulation through ``no_sync``, clipping through ``clip_grad_norm``).

See docs/integrations.md.
"""

import importlib

from shardopt.integrations._owners import owners_of, unwrap_ddp

__all__ = ["owners_of", "unwrap_ddp"]

#: the framework submodules, imported (with their framework) on first attribute access
_FRAMEWORKS = ("accelerate", "lightning", "transformers")


def __getattr__(name: str):
    if name in _FRAMEWORKS:
        return importlib.import_module(f"shardopt.integrations.{name}")
    raise AttributeError(f"module 'shardopt.integrations' has no attribute {name!r}")
