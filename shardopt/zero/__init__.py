"""The ZeRO sharding engine and the DistributedFused* optimizers."""

from shardopt.zero.hsdp import HSDPGroups, hsdp_groups
from shardopt.zero.muon import DistributedFusedMuon
from shardopt.zero.offload.plan import CPUOffload
from shardopt.zero.optimizers import (
    DistributedFusedAdagrad,
    DistributedFusedAdam,
    DistributedFusedLAMB,
    DistributedFusedNovoGrad,
    DistributedFusedSGD,
)

__all__ = [
    "CPUOffload",
    "DistributedFusedAdagrad",
    "DistributedFusedAdam",
    "DistributedFusedLAMB",
    "DistributedFusedMuon",
    "DistributedFusedNovoGrad",
    "DistributedFusedSGD",
    "HSDPGroups",
    "hsdp_groups",
]
