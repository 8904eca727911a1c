"""Building and loading the C++/CUDA extension ``shardopt._C``.

One list of sources and flags serves both routes: ``setup.py`` (ahead of time, ``pip install
--no-build-isolation .``) and the JIT build on first import when no prebuilt module is found
(cached by torch.utils.cpp_extension under ``$SHARDOPT_BUILD_DIR`` or ``~/.cache/shardopt``, rebuilt
when a source changes).

CUDA kernels are compiled when torch has CUDA and nvcc is found (``SHARDOPT_BUILD_CUDA=0`` turns
them off, ``=1`` insists); ``TORCH_CUDA_ARCH_LIST`` picks the architectures. CPU kernels use
``-march=native`` unless ``SHARDOPT_CPU_MARCH`` names another target (``SHARDOPT_CPU_MARCH=""``
for a portable build).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# The optimizers, by source stem: csrc/optim/<stem>_math.h, <stem>_cpu.cpp and <stem>_cuda.cu. Their
# kernel entry points (declarations and Python bindings) are listed in csrc/kernels.def.
OPTIMIZERS = ["adam", "sgd", "adagrad", "lamb", "novograd"]
# The norm and scale kernels: csrc/norm/<stem>_cpu.cpp and <stem>_cuda.cu.
NORM_KERNELS = ["norm", "scale"]

CPU_SOURCES = (
    ["bindings.cpp"]
    + [f"optim/{name}_cpu.cpp" for name in OPTIMIZERS]
    + [f"norm/{name}_cpu.cpp" for name in NORM_KERNELS]
)
CUDA_SOURCES = [f"optim/{name}_cuda.cu" for name in OPTIMIZERS] + [
    f"norm/{name}_cuda.cu" for name in NORM_KERNELS
]


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
    return [str(root / n) for n in names]


def compile_args(with_cuda: bool) -> dict[str, list[str]]:
    """Compiler flags, by compiler ("cxx", "nvcc")."""
    march = os.environ.get("SHARDOPT_CPU_MARCH", "native")
    # -freciprocal-math turns divisions by loop-invariant values (bias corrections) into
    # multiplications; results stay within an ulp, far inside docs/spec.md's tolerances.
    cxx = ["-O3", "-fopenmp", "-fopenmp-simd", "-fno-math-errno", "-freciprocal-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        cxx.append("-mprefer-vector-width=512")
    if march:
        cxx.append(f"-march={march}")
    args = {"cxx": cxx + (["-DSHARDOPT_WITH_CUDA"] if with_cuda else [])}
    if with_cuda:
        args["nvcc"] = [
            "-O3",
            "-DSHARDOPT_WITH_CUDA",
            "--expt-relaxed-constexpr",
            "-lineinfo",
        ]
    return args


LINK_ARGS = ["-fopenmp"]


def _jit_build() -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load

    with_cuda = want_cuda()
    srcs = sources(with_cuda)
    flags = compile_args(with_cuda)
    key = hashlib.sha1(
        repr((torch.__version__, sys.version_info[:2], sorted(flags.items()))).encode()
    ).hexdigest()[:10]
    cache = Path(os.environ.get("SHARDOPT_BUILD_DIR", Path.home() / ".cache" / "shardopt"))
    build_dir = cache / f"torch{torch.__version__.replace('+', '_')}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    stamp = build_dir / "shardopt_C.so"
    if not stamp.exists():
        kind = "C++ and CUDA" if with_cuda else "C++"
        print(
            f"shardopt: building the {kind} extension (first import, a few minutes; cached in "
            f"{build_dir})",
            file=sys.stderr,
            flush=True,
        )
    return load(
        name="shardopt_C",
        sources=srcs,
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags.get("nvcc"),
        extra_ldflags=LINK_ARGS,
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        verbose=os.environ.get("SHARDOPT_BUILD_VERBOSE") == "1",
    )


def load_extension() -> ModuleType:
    """The compiled module: the prebuilt ``shardopt._C`` if installed, else a JIT build."""
    if os.environ.get("SHARDOPT_FORCE_JIT") != "1":
        try:
            return importlib.import_module("shardopt._C")
        except ImportError:
            pass
    return _jit_build()
