"""Integrations with training stacks; each submodule imports its framework only when imported.

- (in ``shardopt.zero.torch_clip``, installed when the first distributed optimizer is built)
  ``torch.nn.utils.clip_grad_norm_`` on the params of a ``DistributedFused*`` optimizer routes to
  ``optimizer.clip_grad_norm``; ``clip_grad_value_`` on them raises.
- ``shardopt.integrations.accelerate``: ``patch(accelerator)``: no DDP wrapper for models whose
  params a ``DistributedFused*`` optimizer holds, ``accelerator.no_sync``/``accumulate`` and
  ``clip_grad_norm_`` routed to the optimizer.
- ``shardopt.integrations.transformers``: ``Trainer``, the HF Trainer with that accelerator.

See docs/integrations.md.
"""

from shardopt.integrations._owners import owners_of, unwrap_ddp

__all__ = ["owners_of", "unwrap_ddp"]
