"""The sharding plan: pure data, no torch.distributed (see Note: buckets and shards in
docs/design.md).

A key is one (param group, param dtype) set of trainable params. A ``ShardLayout`` plans a key
into a ``KeyLayout``: each param's contiguous range of the key space, the buckets that tile it
(each cut into ``world_size`` equal chunks; rank r owns chunk r of every bucket, its shard is its
chunks back to back) and the fragments, one per (param, bucket, rank) intersection. The engine
asks the optimizer for each param group's layout (``DistributedOptimizer.shard_layout(group)``);
everything above the plan (buffers, grad and param sync, state I/O, checkpoints) reads the
``KeyLayout`` only, so layouts are interchangeable.

- ``ElementLayout`` (``plan_key``): params back to back in reverse registration order, every
  bucket split evenly; a param may straddle chunks and buckets.
- ``WholeParamLayout``: each param whole in one rank's chunk of one bucket, ranks balanced by a
  cost of the param's shape, chunks padded to the bucket's fullest (see Note: the whole-param
  plan in whole_param.py).
"""

from shardopt.zero.layout.element import ElementLayout, plan_key
from shardopt.zero.layout.plan import (
    Bucket,
    Fragment,
    KeyLayout,
    ParamShape,
    Range,
    ShardLayout,
)
from shardopt.zero.layout.whole_param import WholeParamLayout, numel_cost

__all__ = [
    "Bucket",
    "ElementLayout",
    "Fragment",
    "KeyLayout",
    "ParamShape",
    "Range",
    "ShardLayout",
    "WholeParamLayout",
    "numel_cost",
    "plan_key",
]
