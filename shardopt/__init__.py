"""shardopt: ZeRO-sharded fused multi-tensor optimizers for PyTorch (CPU and CUDA kernels)."""

from shardopt._version import __version__
from shardopt.kernels import cuda_available
from shardopt.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from shardopt.zero import (
    CPUOffload,
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
    "DistributedFusedNovoGrad",
    "DistributedFusedSGD",
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
    "__version__",
    "cuda_available",
]
