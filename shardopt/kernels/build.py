"""What the C++/CUDA extension ``shardopt._C`` is built from: sources and compiler flags.

One list of sources and flags serves both routes: ``setup.py`` (ahead of time: ``pip install``,
``pip wheel``, the editable install) and the just-in-time build at the first use of a kernel when
no prebuilt module is installed (cached by torch.utils.cpp_extension under ``$SHARDOPT_BUILD_DIR``
or ``~/.cache/shardopt``, rebuilt when a source changes).

Sources: the copy shipped inside the package (``shardopt/_csrc``, written by setup.py's build_py
into wheels and non-editable installs) first, else the repository's ``csrc/`` (checkouts, editable
installs).

CPU instruction sets (see Note: CPU capability dispatch in docs/design.md): an ahead-of-time
build on x86-64 compiles the CPU kernels three times, into ``shardopt._C`` (baseline x86-64-v2,
also the CUDA kernels), ``shardopt._C_avx2`` (x86-64-v3) and ``shardopt._C_avx512`` (x86-64-v4,
512-bit vectors); the CPU kernels come from the best one the running CPU supports
(``SHARDOPT_CPU_CAPABILITY=default|avx2|avx512`` picks a lower one). Other architectures build the
baseline only. The JIT build is one module for this machine: ``-march=native`` unless
``SHARDOPT_CPU_MARCH`` names another target (``SHARDOPT_CPU_MARCH=""`` for none).

Each module's entry point checks the CPU before any code built for its level runs and raises
ImportError on a CPU below it (Note: ISA guard in csrc/bindings.cpp), so importing
``shardopt._C_avx512`` on a CPU without AVX-512 is an ImportError, never SIGILL.

CUDA kernels are compiled when torch has CUDA and nvcc is found (``SHARDOPT_BUILD_CUDA=0`` turns
them off, ``=1`` insists); ``TORCH_CUDA_ARCH_LIST`` picks the architectures.

This module imports nothing of shardopt: setup.py executes it by path, before the package can be
imported. Which CPU is running is ``cpu_isa``; loading the modules is ``loader``; the JIT build is
``jit``.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # shardopt/
# Written next to the prebuilt modules by setup.py's build_ext: the torch they were built against.
BUILD_INFO = "_build_info.json"


def _find_csrc() -> Path:
    """The package's shipped copy of the sources if present, else the repository's csrc/."""
    for root in (PACKAGE / "_csrc", PACKAGE.parent / "csrc"):
        if (root / "bindings.cpp").is_file():
            return root
    return PACKAGE.parent / "csrc"


CSRC = _find_csrc()

# The optimizers, by source stem: csrc/optim/<stem>_math.h, <stem>_cpu.cpp and <stem>_cuda.cu. Their
# kernel entry points (declarations and Python bindings) are listed in csrc/kernels.def.
OPTIMIZERS = [
    "adam",
    "adam_compact",
    "adam_blockwise",
    "sgd",
    "adagrad",
    "lamb",
    "novograd",
    "muon",
]
# The norm and scale kernels: csrc/norm/<stem>_cpu.cpp and <stem>_cuda.cu.
NORM_KERNELS = ["norm", "scale"]

CPU_SOURCES = (
    ["bindings.cpp", "multi_tensor/checks.cpp"]
    + [f"optim/{name}_cpu.cpp" for name in OPTIMIZERS]
    + [f"norm/{name}_cpu.cpp" for name in NORM_KERNELS]
)
# Batched matmuls for Newton-Schulz (the addend read, not copied; symmetric products by their
# lower block rows) on cuBLASLt: CUDA only, no spec
LINALG_CUDA_SOURCES = ["linalg/matmul_checks.cpp", "linalg/lt_matmul.cu", "linalg/bmm_add_cuda.cu"]
CUDA_SOURCES = (
    [f"optim/{name}_cuda.cu" for name in OPTIMIZERS]
    + [f"norm/{name}_cuda.cu" for name in NORM_KERNELS]
    + LINALG_CUDA_SOURCES
)
# nccl_ub=True's own allocator (ncclMemAlloc behind torch's pluggable allocator): built with the
# CUDA kernels when nccl.h is found (see nccl_include_dir)
NCCL_SOURCES = ["dist/nccl_allocator.cpp"]


def nccl_include_dir() -> str | None:
    """The directory of nccl.h: ``$NCCL_INCLUDE_DIR``, ``$NCCL_HOME/include``, torch's CUDA wheel
    (the nvidia-nccl package), ``$CUDA_HOME/include``, /usr/include; None if none has it."""
    import glob

    from torch.utils.cpp_extension import CUDA_HOME

    roots = [os.environ.get("NCCL_INCLUDE_DIR", "")]
    roots.append(
        os.path.join(os.environ["NCCL_HOME"], "include") if "NCCL_HOME" in os.environ else ""
    )
    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations or []) if spec else []:
        roots += sorted(
            os.path.dirname(h) for h in glob.glob(f"{base}/**/include/nccl.h", recursive=True)
        )
    roots += [os.path.join(CUDA_HOME, "include") if CUDA_HOME else "", "/usr/include"]
    return next((r for r in roots if r and os.path.isfile(os.path.join(r, "nccl.h"))), None)


def want_cuda() -> bool:
    """Whether CUDA kernels will be compiled: torch has CUDA and nvcc is found (env overrides)."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    flag = os.environ.get("SHARDOPT_BUILD_CUDA")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1" and not available:
        raise RuntimeError(
            "SHARDOPT_BUILD_CUDA=1 but torch has no CUDA or nvcc was not found (set CUDA_HOME)"
        )
    return available and flag != "0"


def sources(with_cuda: bool, root: Path = CSRC) -> list[str]:
    """Absolute source paths for the extension."""
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])
    if with_cuda and nccl_include_dir() is not None:
        names += NCCL_SOURCES
    return [str(root / n) for n in names]


# -- compiler flags ------------------------------------------------------------------------------

# No -freciprocal-math: the divisions by the bias corrections stay divisions, as nvcc's IEEE `/`,
# so the CPU kernels give the CUDA kernels' bits (CPU offload runs the CPU kernels in place of the
# CUDA ones: docs/spec.md); the loops are DRAM-bound, the divisions cost nothing measurable.
# -ffp-contract=off: no implicit fused multiply-adds (explicit fma() calls stay). GCC otherwise
# fuses a * b + c * d one way in a loop's vector body and the other in its epilogue, so an
# element's bits would depend on where it falls; with it every loop over the same math gives the
# same bits (adam_compact's fp32 path is bit-identical to adam's: docs/spec.md).
_CXX_COMMON = [
    "-O3",
    "-fopenmp",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-ffp-contract=off",
]
LINK_ARGS = ["-fopenmp"]
# Ahead-of-time (release) builds: no debug info (Python's own CFLAGS carry -g: 21 MB modules), and
# calls inside a module bind to that module's own copies, never to a sibling ISA module's.
RELEASE_COMPILE_ARGS = ["-g0"]
RELEASE_LINK_ARGS = (
    ["-Wl,-Bsymbolic-functions", "-Wl,--strip-debug"] if sys.platform == "linux" else []
)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_isa_levels() -> list[tuple[str, str, list[str]]]:
    """(capability, module name, CPU flags) of each ahead-of-time CPU build, lowest level first.

    Each level is a complete pybind11 module built from the same sources (TORCH_EXTENSION_NAME
    comes from the module name); ``_C`` is the baseline and also holds the CUDA kernels (see
    Note: CPU capability dispatch in docs/design.md).
    """
    if _is_x86():
        return [
            ("default", "_C", ["-march=x86-64-v2"]),
            ("avx2", "_C_avx2", ["-march=x86-64-v3"]),
            ("avx512", "_C_avx512", ["-march=x86-64-v4", "-mprefer-vector-width=512"]),
        ]
    return [("default", "_C", [])]  # aarch64: armv8-a with NEON; others: the compiler's default


def jit_cpu_flags() -> list[str]:
    """CPU flags of the JIT build: this machine's ISA (``SHARDOPT_CPU_MARCH``, default native)."""
    march = os.environ.get("SHARDOPT_CPU_MARCH", "native")
    flags = ["-mprefer-vector-width=512"] if _is_x86() else []
    return flags + ([f"-march={march}"] if march else [])


def compile_args(with_cuda: bool, cpu_flags: list[str] | None = None) -> dict[str, list[str]]:
    """Compiler flags, by compiler ("cxx", "nvcc"); ``cpu_flags`` default to the JIT build's."""
    cxx = _CXX_COMMON + (jit_cpu_flags() if cpu_flags is None else list(cpu_flags))
    args = {"cxx": cxx + (["-DSHARDOPT_WITH_CUDA"] if with_cuda else [])}
    nccl = nccl_include_dir() if with_cuda else None
    if nccl is not None:
        args["cxx"] += ["-DSHARDOPT_WITH_NCCL_ALLOCATOR", f"-I{nccl}"]
    if with_cuda:
        args["nvcc"] = [
            "-O3",
            "-DSHARDOPT_WITH_CUDA",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            # no implicit FMA contraction, as -ffp-contract=off on the CPU: nvcc fuses the same
            # expression differently in different kernels (adam_compact's fp32 path must give
            # adam's bits); the kernels are memory-bound, so this costs nothing measurable
            "--fmad=false",
        ]
    return args
