"""shardopt: ZeRO-sharded fused multi-tensor optimizers for PyTorch (CPU and CUDA kernels)."""

from shardopt._ops import cuda_available
from shardopt.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from shardopt.zero import (
    DistributedFusedAdagrad,
    DistributedFusedAdam,
    DistributedFusedLAMB,
    DistributedFusedNovoGrad,
    DistributedFusedSGD,
)

__version__ = "0.1.0"

__all__ = [
    "DistributedFusedAdagrad",
    "DistributedFusedAdam",
    "DistributedFusedLAMB",
    "DistributedFusedNovoGrad",
    "DistributedFusedSGD",
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
    "cuda_available",
]
