"""shardopt.kernels: everything between the Python optimizers and ``csrc/``.

One role per module, imported in this order (no module imports one listed after it, nothing
here imports shardopt.optimizers or shardopt.zero):

- ``build``: the sources and compiler flags of the extension (setup.py executes it by path).
- ``cpu_isa``: which x86-64 level the running CPU has, and the one whose kernels this process uses.
- ``jit``: the just-in-time build when no prebuilt module is installed.
- ``loader``: loading ``shardopt._C`` and the per-ISA CPU module, the backend of a device.
- ``specs``: one declaration per kernel (its schema), from which the wrapper and op derive.
- ``dtensor``, ``layouts``: fitting tensor lists to the kernels (DTensor shards, layouts).
- ``dispatch``: the one dispatch point (``run``) and the optimizers' device checks.
- ``ops``: the Python wrapper of every kernel; ``custom_ops``: the ``torch.library`` op of every
  kernel (registered at the first torch.compile trace).
- ``compact``: the compact-state Adam entry (``adam_compact``).
- ``matmul``: ``bmm_add``, baddbmm without its copy of the addend on CUDA, and
  ``symmetric_bmm_add``, a symmetric product by its lower block rows (Newton-Schulz's products;
  not multi-tensor kernels, so no spec), and ``set_matmul_tuning``, their opt-in timing of
  cuBLASLt's algorithms.

The names below are the layer's interface to the optimizers (docs/kernels.md). ``adam_compact``
here is the compact-state entry (it checks the lists against their ``state_format`` and runs the
``adam_compact`` or ``adam_blockwise`` kernel, whose raw wrappers are ``ops.adam_compact`` and
``ops.adam_blockwise``).
"""

from shardopt.kernels.compact import adam_compact
from shardopt.kernels.dispatch import as_is_kwargs, check_param_devices, common_device
from shardopt.kernels.layouts import fits_as_is, is_dense, same_layout
from shardopt.kernels.loader import (
    backend,
    chunk_size,
    cpu_extension,
    cuda_available,
    describe,
    extension,
)
from shardopt.kernels.matmul import (
    bmm_add,
    matmul_tuning,
    matmul_tuning_stats,
    set_matmul_tuning,
    symmetric_bmm_add,
)
from shardopt.kernels.ops import (
    adagrad,
    adam,
    lamb_stage1,
    lamb_stage2,
    muon_apply,
    muon_momentum,
    norm,
    novograd,
    novograd_step,
    scale,
    sgd,
)

__all__ = [
    "adagrad",
    "adam",
    "adam_compact",
    "as_is_kwargs",
    "bmm_add",
    "matmul_tuning",
    "matmul_tuning_stats",
    "set_matmul_tuning",
    "symmetric_bmm_add",
    "backend",
    "check_param_devices",
    "chunk_size",
    "common_device",
    "cpu_extension",
    "cuda_available",
    "describe",
    "extension",
    "fits_as_is",
    "is_dense",
    "lamb_stage1",
    "lamb_stage2",
    "norm",
    "muon_apply",
    "muon_momentum",
    "novograd",
    "novograd_step",
    "same_layout",
    "scale",
    "sgd",
]
