"""bench_train.py's environment: shardopt (from the checkout or the install), torch's tensor
collectives under this release's names, shared constants."""

from __future__ import annotations

import torch.distributed as dist
from bench_common import (
    import_shardopt,
)

shardopt = import_shardopt()

# torch 2.13 renamed the tensor collectives (*_single); older releases only have *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WEIGHT_DECAY = 0.1
GIB = 2**30
