"""The just-in-time build: one extension module for this machine, compiled at the first kernel use
when no prebuilt module is installed (or with ``SHARDOPT_FORCE_JIT=1``), cached by
torch.utils.cpp_extension under ``$SHARDOPT_BUILD_DIR`` or ``~/.cache/shardopt`` and rebuilt when a
source changes. Sources and flags are ``build``'s, as setup.py's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from shardopt.kernels import build, cpu_isa

logger = logging.getLogger("shardopt")


def _log_this_process() -> bool:
    """One message per node: only local rank 0 (torchrun's LOCAL_RANK) or a single process."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def jit_build_dir(with_cuda: bool, flags: dict[str, list[str]]) -> Path:
    """The cache folder of the JIT build for this torch, Python, flags and CPU."""
    import torch

    cap = cpu_isa.detect_cpu_capability() if build._is_x86() else platform.machine()
    # -march=native means this CPU's exact features: a home folder shared by unlike nodes must not
    # hand one node's build to another.
    native = any(f == "-march=native" for f in flags["cxx"])
    isa = (cap, sorted(cpu_isa.cpu_flags()) if native else None)
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


def jit_build() -> ModuleType:
    """Builds (or takes from the cache) one module for this machine and loads it."""
    import torch
    from torch.utils.cpp_extension import load

    with_cuda = build.want_cuda()
    flags = build.compile_args(with_cuda)
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
            sources=build.sources(with_cuda),
            extra_cflags=flags["cxx"],
            extra_cuda_cflags=flags.get("nvcc"),
            extra_ldflags=build.LINK_ARGS,
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
