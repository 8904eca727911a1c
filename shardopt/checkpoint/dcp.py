"""torch.distributed.checkpoint (DCP) interop: ``get_state_dict`` / ``set_state_dict`` for a
``DistributedFused*`` optimizer, built on its state-I/O methods ``sharded_state_dict`` and
``load_sharded_state_dict`` (the DTensor layout is the optimizer's own: see
``shardopt/zero/dcp_state.py``, Note: re-partition).
"""

from __future__ import annotations

import torch


def get_state_dict(model: torch.nn.Module, optimizer, *, options=None):
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for a ``DistributedFused*``
    optimizer: ``(model_state_dict, optimizer_state_dict)`` with the optimizer state sharded
    (``optimizer.sharded_state_dict(model)``). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=options), optimizer.sharded_state_dict(model)


def set_state_dict(
    model: torch.nn.Module, optimizer, *, model_state_dict, optim_state_dict, options=None
):
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for a ``DistributedFused*``
    optimizer (after ``dcp.load`` into ``get_state_dict``'s structure). Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    keys = set_model_state_dict(model, model_state_dict, options=options)
    optimizer.load_sharded_state_dict(optim_state_dict, model)
    return keys
