"""Single-process fused optimizers, one module per algorithm (definitions: shardopt/algorithms/)."""

from shardopt.optimizers.adagrad import FusedAdagrad
from shardopt.optimizers.adam import FusedAdam
from shardopt.optimizers.lamb import FusedLAMB
from shardopt.optimizers.mixed_precision_lamb import FusedMixedPrecisionLamb
from shardopt.optimizers.muon import FusedMuon
from shardopt.optimizers.muon_groups import muon_param_groups
from shardopt.optimizers.novograd import FusedNovoGrad
from shardopt.optimizers.sgd import FusedSGD

__all__ = [
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedMuon",
    "FusedNovoGrad",
    "FusedSGD",
    "muon_param_groups",
]
