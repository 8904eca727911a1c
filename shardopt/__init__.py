"""shardopt: ZeRO-sharded fused multi-tensor optimizers for PyTorch (CPU and CUDA kernels).

``shardopt.checkpoint`` and ``shardopt.integrations`` are imported on first use, so
``import shardopt`` then ``shardopt.checkpoint.save(...)`` works as written and importing shardopt
imports no training framework.
"""

import importlib

from shardopt._version import __version__
from shardopt.kernels import cuda_available
from shardopt.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedMuon,
    FusedNovoGrad,
    FusedSGD,
    muon_param_groups,
)
from shardopt.zero import (
    CPUOffload,
    DistributedFusedAdagrad,
    DistributedFusedAdam,
    DistributedFusedLAMB,
    DistributedFusedMuon,
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
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedMuon",
    "FusedNovoGrad",
    "FusedSGD",
    "__version__",
    "cuda_available",
    "muon_param_groups",
]

#: subpackages imported on first attribute access (PEP 562)
_LAZY = ("checkpoint", "integrations")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"shardopt.{name}")
    raise AttributeError(f"module 'shardopt' has no attribute {name!r}")
