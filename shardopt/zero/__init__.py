"""The ZeRO sharding engine and the DistributedFused* optimizers."""

from shardopt.zero.hsdp import HSDPGroups, hsdp_groups
from shardopt.zero.optimizers import (
    DistributedFusedAdagrad,
    DistributedFusedAdam,
    DistributedFusedLAMB,
    DistributedFusedNovoGrad,
    DistributedFusedSGD,
)

__all__ = [
    "DistributedFusedAdagrad",
    "DistributedFusedAdam",
    "DistributedFusedLAMB",
    "DistributedFusedNovoGrad",
    "DistributedFusedSGD",
    "HSDPGroups",
    "hsdp_groups",
]
