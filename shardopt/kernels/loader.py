"""Loading the compiled kernels: the prebuilt ``shardopt._C`` (or a JIT build), the per-ISA module
whose CPU kernels serve CPU tensors, and the backend (``cpu`` or ``cuda`` submodule) of a device.

There is no silent Python fallback: a device without compiled kernels is an error that says how to
build them. Both modules are loaded once per process, at the first kernel use (``extension()``,
``cpu_extension()``), not at ``import shardopt``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from types import ModuleType

import torch

from shardopt.kernels import build, cpu_isa, jit

_C: ModuleType | None = None
_CPU: ModuleType | None = None


def build_info() -> dict | None:
    """What setup.py recorded about the prebuilt modules (torch version, CUDA, modules), if any."""
    try:
        return json.loads((build.PACKAGE / build.BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def _public(version: str) -> str:
    return version.split("+")[0]


def _rebuild_advice() -> str:
    return (
        f"rebuild shardopt against torch {torch.__version__} (`pip install --no-build-isolation "
        "--force-reinstall --no-deps` with the sdist or checkout; `pip install "
        "--no-build-isolation -e .` for an editable install), install a wheel built for it, or "
        "set SHARDOPT_FORCE_JIT=1 to build it just in time"
    )


def check_build_info(info: dict | None) -> None:
    """Raises ImportError when the prebuilt modules were built against another torch."""
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


class CpuLevelError(ImportError):
    """A module's own CPU check refused the import: this CPU lacks the module's ISA level (Note:
    ISA guard in csrc/bindings.cpp)."""


def _import_prebuilt(name: str) -> ModuleType:
    """Imports ``shardopt.<name>``: ModuleNotFoundError if absent, CpuLevelError if built for a
    CPU level this one lacks, ImportError naming the fix if present but unloadable otherwise
    (built against another torch)."""
    fullname = f"shardopt.{name}"
    spec = importlib.util.find_spec(fullname)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
    check_build_info(build_info())
    try:
        return importlib.import_module(fullname)
    except ImportError as e:
        if " CPUs and this CPU lacks " in str(e):
            raise CpuLevelError(str(e)) from e
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
    return jit.jit_build()


def load_cpu_extension(main: ModuleType) -> ModuleType:
    """The module whose ``cpu`` kernels serve CPU tensors (see Note: CPU capability dispatch).

    For a prebuilt ``main``: the highest ISA module installed that this CPU runs (at most
    SHARDOPT_CPU_CAPABILITY); a JIT-built ``main`` is itself built for this CPU.
    """
    if main.__name__ != "shardopt._C":
        return main
    cap = cpu_isa.cpu_capability()
    levels = build.cpu_isa_levels()
    rank = cpu_isa.CAPABILITIES.index
    usable = [lv for lv in levels if rank(lv[0]) <= rank(cap)]
    for level, name, _ in reversed(usable):
        if name == "_C":
            return main
        try:
            return _import_prebuilt(name)
        except CpuLevelError:
            continue  # /proc/cpuinfo promised more than the CPU check found: the next level down
        except ModuleNotFoundError as e:
            if e.name != f"shardopt.{name}":
                raise
            if os.environ.get("SHARDOPT_CPU_CAPABILITY") and level == cap:
                raise RuntimeError(
                    f"SHARDOPT_CPU_CAPABILITY={cap} but this install has no shardopt.{name}"
                ) from None
    return main


def extension() -> ModuleType:
    """The loaded ``shardopt._C`` (built just in time on first use if not installed)."""
    global _C
    if _C is None:
        _C = load_extension()
    return _C


def cpu_extension() -> ModuleType:
    """The module whose ``cpu`` kernels serve CPU tensors: the ISA build for this CPU.

    See Note: CPU capability dispatch in docs/design.md.
    """
    global _CPU
    if _CPU is None:
        _CPU = load_cpu_extension(extension())
    return _CPU


def cuda_available() -> bool:
    """True when the loaded extension was compiled with CUDA kernels."""
    return bool(extension().has_cuda)


def chunk_size(device: torch.device | str) -> int:
    """Elements per (tensor, chunk) work item of the backend that serves ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(extension().cuda_chunk_size)
    return int(cpu_extension().cpu_chunk_size)


def backend(device: torch.device) -> ModuleType:
    """The kernels for tensors on ``device``: the ``cpu`` or ``cuda`` submodule of the extension."""
    if device.type == "cpu":
        return cpu_extension().cpu
    ext = extension()
    if device.type == "cuda":
        if not ext.has_cuda:
            raise RuntimeError(
                "shardopt was built without CUDA kernels, so it cannot update CUDA tensors. "
                "Rebuild with a CUDA-enabled torch and nvcc on PATH (or CUDA_HOME set): "
                "`pip install --no-build-isolation .` or remove the JIT cache "
                "(~/.cache/shardopt) and import again; SHARDOPT_BUILD_CUDA=1 makes a missing "
                "toolkit an error."
            )
        return ext.cuda
    raise RuntimeError(f"shardopt has no kernels for {device.type} tensors (cpu and cuda only)")


def describe() -> str:
    """Which modules serve the kernels, for bug reports and the packaging smoke test."""
    from shardopt._version import __version__

    main, cpu = extension(), cpu_extension()
    info = build_info() if main.__name__ == "shardopt._C" else None
    built = f", built against torch {info['torch']}" if info else ""
    return "\n".join(
        [
            f"shardopt {__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}",
            f"extension: {main.__name__} ({main.__file__}){built}",
            f"CUDA kernels: {'yes' if main.has_cuda else 'no'}",
            f"CPU kernels: {cpu.__name__} (CPU supports {cpu_isa.detect_cpu_capability()})",
        ]
    )
