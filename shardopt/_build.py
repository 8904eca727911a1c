"""Building and loading the C++/CUDA extension ``shardopt._C``.

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

CUDA kernels are compiled when torch has CUDA and nvcc is found (``SHARDOPT_BUILD_CUDA=0`` turns
them off, ``=1`` insists); ``TORCH_CUDA_ARCH_LIST`` picks the architectures.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("shardopt")

PACKAGE = Path(__file__).resolve().parent
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
OPTIMIZERS = ["adam", "adam_compact", "adam_blockwise", "sgd", "adagrad", "lamb", "novograd"]
# The norm and scale kernels: csrc/norm/<stem>_cpu.cpp and <stem>_cuda.cu.
NORM_KERNELS = ["norm", "scale"]

CPU_SOURCES = (
    ["bindings.cpp", "multi_tensor/checks.cpp"]
    + [f"optim/{name}_cpu.cpp" for name in OPTIMIZERS]
    + [f"norm/{name}_cpu.cpp" for name in NORM_KERNELS]
)
CUDA_SOURCES = [f"optim/{name}_cuda.cu" for name in OPTIMIZERS] + [
    f"norm/{name}_cuda.cu" for name in NORM_KERNELS
]
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

# -freciprocal-math turns divisions by loop-invariant values (bias corrections) into
# multiplications; results stay within an ulp, far inside docs/spec.md's tolerances.
# -ffp-contract=off: no implicit fused multiply-adds (explicit fma() calls stay). GCC otherwise
# fuses a * b + c * d one way in a loop's vector body and the other in its epilogue, so an
# element's bits would depend on where it falls; with it every loop over the same math gives the
# same bits (adam_compact's fp32 path is bit-identical to adam's: docs/spec.md).
_CXX_COMMON = [
    "-O3",
    "-fopenmp",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-freciprocal-math",
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


# -- which CPU is this ---------------------------------------------------------------------------

# /proc/cpuinfo flags each x86-64 level needs on top of the one below (x86-64 psABI levels v2, v3,
# v4; lzcnt shows as "abm"). The kernel hides AVX/AVX-512 flags the OS does not enable.
_X86_LEVEL_FLAGS = {
    "default": {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"},
    "avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
CAPABILITIES = ("default", "avx2", "avx512")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detect_cpu_capability(flags: frozenset[str] | None = None) -> str | None:
    """The highest of ``CAPABILITIES`` this CPU runs: "default", "avx2" or "avx512".

    None on an x86-64 CPU below x86-64-v2 (older than about 2009), which the baseline module does
    not run on. x86-64 levels come from /proc/cpuinfo, else torch's own detection
    (torch.backends.cpu.get_cpu_capability()); other architectures are "default".
    """
    if not _is_x86():
        return "default"
    flags = cpu_flags() if flags is None else flags
    if not flags:
        import torch

        torch_cap = torch.backends.cpu.get_cpu_capability().lower()
        return torch_cap if torch_cap in CAPABILITIES else "default"
    best = None
    needed: set[str] = set()
    for cap in CAPABILITIES:
        needed |= _X86_LEVEL_FLAGS[cap]
        if not needed <= flags:
            break
        best = cap
    return best


def cpu_capability() -> str:
    """The ISA level whose CPU kernels this process uses: detected, or SHARDOPT_CPU_CAPABILITY."""
    detected = detect_cpu_capability()
    if detected is None:
        raise RuntimeError(
            "shardopt: this CPU lacks x86-64-v2 (SSE4.2, POPCNT), which the prebuilt CPU kernels "
            "need; set SHARDOPT_FORCE_JIT=1 to build them for this CPU"
        )
    wanted = os.environ.get("SHARDOPT_CPU_CAPABILITY", "").strip().lower()
    if not wanted:
        return detected
    if wanted not in CAPABILITIES:
        raise RuntimeError(
            f"SHARDOPT_CPU_CAPABILITY={wanted!r}: expected one of {', '.join(CAPABILITIES)}"
        )
    if CAPABILITIES.index(wanted) > CAPABILITIES.index(detected):
        raise RuntimeError(
            f"SHARDOPT_CPU_CAPABILITY={wanted} but this CPU supports up to {detected}: its kernels "
            "would stop on an illegal instruction"
        )
    return wanted


# -- loading -------------------------------------------------------------------------------------


def build_info() -> dict | None:
    """What setup.py recorded about the prebuilt modules (torch version, CUDA, modules), if any."""
    try:
        return json.loads((PACKAGE / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def _public(version: str) -> str:
    return version.split("+")[0]


def _rebuild_advice() -> str:
    import torch

    return (
        f"rebuild shardopt against torch {torch.__version__} (`pip install --no-build-isolation "
        "--force-reinstall --no-deps` with the sdist or checkout; `pip install "
        "--no-build-isolation -e .` for an editable install), install a wheel built for it, or "
        "set SHARDOPT_FORCE_JIT=1 to build it just in time"
    )


def check_build_info(info: dict | None) -> None:
    """Raises ImportError when the prebuilt modules were built against another torch."""
    import torch

    built = (info or {}).get("torch")
    if built and _public(built) != _public(torch.__version__):
        raise ImportError(
            f"shardopt's prebuilt extension was built against torch {built}, but torch "
            f"{torch.__version__} is running: {_rebuild_advice()}"
        )
    if (info or {}).get("cuda") and torch.version.cuda is None:
        raise ImportError(
            f"shardopt's prebuilt extension has CUDA kernels (built against torch {built}), but "
            f"torch {torch.__version__} has no CUDA: {_rebuild_advice()}"
        )


def _import_prebuilt(name: str) -> ModuleType:
    """Imports ``shardopt.<name>``: ModuleNotFoundError if absent, ImportError naming the fix if
    present but unloadable (built against another torch)."""
    fullname = f"shardopt.{name}"
    spec = importlib.util.find_spec(fullname)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
    check_build_info(build_info())
    try:
        return importlib.import_module(fullname)
    except ImportError as e:
        built = (build_info() or {}).get("torch")
        against = f" (built against torch {built})" if built else ""
        raise ImportError(
            f"shardopt's prebuilt extension {spec.origin}{against} does not load ({e}); "
            f"{_rebuild_advice()}"
        ) from e


def load_extension() -> ModuleType:
    """The compiled module: the prebuilt ``shardopt._C`` if installed, else a JIT build.

    A prebuilt module that does not load (built against another torch) is an ImportError that
    says so, not a silent rebuild; ``SHARDOPT_FORCE_JIT=1`` ignores it.
    """
    if os.environ.get("SHARDOPT_FORCE_JIT") != "1":
        try:
            return _import_prebuilt("_C")
        except ModuleNotFoundError as e:
            if e.name != "shardopt._C":
                raise
    return _jit_build()


def load_cpu_extension(main: ModuleType) -> ModuleType:
    """The module whose ``cpu`` kernels serve CPU tensors (see Note: CPU capability dispatch).

    For a prebuilt ``main``: the highest ISA module installed that this CPU runs (at most
    SHARDOPT_CPU_CAPABILITY); a JIT-built ``main`` is itself built for this CPU.
    """
    if main.__name__ != "shardopt._C":
        return main
    cap = cpu_capability()
    levels = cpu_isa_levels()
    usable = [lv for lv in levels if CAPABILITIES.index(lv[0]) <= CAPABILITIES.index(cap)]
    for level, name, _ in reversed(usable):
        if name == "_C":
            return main
        try:
            return _import_prebuilt(name)
        except ModuleNotFoundError as e:
            if e.name != f"shardopt.{name}":
                raise
            if os.environ.get("SHARDOPT_CPU_CAPABILITY") and level == cap:
                raise RuntimeError(
                    f"SHARDOPT_CPU_CAPABILITY={cap} but this install has no shardopt.{name}"
                ) from None
    return main


# -- the just-in-time build ----------------------------------------------------------------------


def _log_this_process() -> bool:
    """One message per node: only local rank 0 (torchrun's LOCAL_RANK) or a single process."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def jit_build_dir(with_cuda: bool, flags: dict[str, list[str]]) -> Path:
    """The cache folder of the JIT build for this torch, Python, flags and CPU."""
    import torch

    cap = detect_cpu_capability() if _is_x86() else platform.machine()
    # -march=native means this CPU's exact features: a home folder shared by unlike nodes must not
    # hand one node's build to another.
    native = any(f == "-march=native" for f in flags["cxx"])
    isa = (cap, sorted(cpu_flags()) if native else None)
    key = hashlib.sha1(
        repr(
            (torch.__version__, sys.version_info[:2], with_cuda, sorted(flags.items()), isa)
        ).encode()
    ).hexdigest()[:10]
    cache = Path(os.environ.get("SHARDOPT_BUILD_DIR", Path.home() / ".cache" / "shardopt"))
    return cache / f"torch{torch.__version__.replace('+', '_')}-{cap}-{key}"


def _failure_reason(text: str) -> str:
    """The first compiler/linker error line of a build log (else its first line), shortened."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln.lower() and not ln.startswith("Error building")]
    line = (errors or lines or ["no output"])[0]
    return line if len(line) <= 240 else line[:237] + "..."


def _jit_build() -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load

    with_cuda = want_cuda()
    flags = compile_args(with_cuda)
    build_dir = jit_build_dir(with_cuda, flags)
    what = "C++ and CUDA" if with_cuda else "C++"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(shlex.split(cxx)[0] if cxx.strip() else "c++") is None:
        raise RuntimeError(
            f"shardopt: no prebuilt extension for torch {torch.__version__} and no C++ compiler "
            f"to build one ({cxx!r} is not on PATH): install g++ or clang++ (or set CXX), or "
            "install a shardopt wheel built against this torch"
        )
    build_dir.mkdir(parents=True, exist_ok=True)
    first = not (build_dir / "shardopt_C.so").exists()
    if first and _log_this_process():
        logger.warning(
            "shardopt: building its %s extension for torch %s and this CPU (%s) just in time; "
            "about a minute, once; cached in %s",
            what,
            torch.__version__,
            " ".join(f for f in flags["cxx"] if f.startswith(("-march", "-mprefer")))
            or "no -march",
            build_dir,
        )
    verbose = os.environ.get("SHARDOPT_BUILD_VERBOSE") == "1"
    start = time.perf_counter()
    try:
        module = load(
            name="shardopt_C",
            sources=sources(with_cuda),
            extra_cflags=flags["cxx"],
            extra_cuda_cflags=flags.get("nvcc"),
            extra_ldflags=LINK_ARGS,
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=verbose,
        )
    except Exception as e:  # any failure becomes one actionable line
        log = build_dir / "build.log"
        text = str(e)
        log.write_text(text + "\n")
        raise RuntimeError(
            f"shardopt: building its {what} extension failed ({_failure_reason(text)}); full "
            f"log: {log}; SHARDOPT_BUILD_VERBOSE=1 shows the compiler output"
        ) from None
    if first and _log_this_process():
        logger.info("shardopt: extension built in %.0f s", time.perf_counter() - start)
    return module


def describe() -> str:
    """Which modules serve the kernels, for bug reports and the packaging smoke test."""
    import torch

    from shardopt import _ops
    from shardopt._version import __version__

    main, cpu = _ops.extension(), _ops.cpu_extension()
    info = build_info() if main.__name__ == "shardopt._C" else None
    built = f", built against torch {info['torch']}" if info else ""
    return "\n".join(
        [
            f"shardopt {__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}",
            f"extension: {main.__name__} ({main.__file__}){built}",
            f"CUDA kernels: {'yes' if main.has_cuda else 'no'}",
            f"CPU kernels: {cpu.__name__} (CPU supports {detect_cpu_capability()})",
        ]
    )
