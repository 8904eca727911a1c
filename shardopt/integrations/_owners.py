"""Which DistributedFused* optimizer holds a param (framework-independent helpers)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt.zero.sharded_params import owner_of


def owners_of(params: Iterable[torch.Tensor] | torch.nn.Module) -> list:
    """The distinct ``DistributedFused*`` optimizers holding any of ``params`` (or a module's)."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    out: list = []
    for p in params:
        o = owner_of(p)
        if o is not None and all(o is not x for x in out):
            out.append(o)
    return out


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``model`` itself otherwise).

    A ``DistributedFused*`` optimizer syncs grads itself; train the returned module (its params
    are the wrapper's) and drop the wrapper, whose reducer hooks go with it.
    """
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model
