"""Which CPU is running: its x86-64 level, and the level whose CPU kernels this process uses.

The levels are the ahead-of-time builds of ``build.cpu_isa_levels()`` ("default" x86-64-v2,
"avx2" x86-64-v3, "avx512" x86-64-v4); ``loader`` picks the module of the highest one this CPU
runs (Note: CPU capability dispatch in docs/design.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from shardopt.kernels import build

# /proc/cpuinfo flags each x86-64 level needs on top of the one below (x86-64 psABI levels v2, v3,
# v4; lzcnt shows as "abm"). The kernel hides AVX/AVX-512 flags the OS does not enable.
_X86_LEVEL_FLAGS = {
    "default": {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"},
    "avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
CAPABILITIES = ("default", "avx2", "avx512")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none).

    ``SHARDOPT_SIMULATE_CPU_LEVEL=default|avx2`` hides the flags of the levels above it, as the
    extension modules' own check does (Note: ISA guard in csrc/bindings.cpp): the tests use it to
    run on any machine what a CPU of that level sees.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = frozenset(value.split())
            break
    simulated = os.environ.get("SHARDOPT_SIMULATE_CPU_LEVEL", "").strip().lower()
    if simulated in CAPABILITIES:
        for cap in CAPABILITIES[CAPABILITIES.index(simulated) + 1 :]:
            flags -= _X86_LEVEL_FLAGS[cap]
    return flags


def detect_cpu_capability(flags: frozenset[str] | None = None) -> str | None:
    """The highest of ``CAPABILITIES`` this CPU runs: "default", "avx2" or "avx512".

    None on an x86-64 CPU below x86-64-v2 (older than about 2009), which the baseline module does
    not run on. x86-64 levels come from /proc/cpuinfo, else torch's own detection
    (torch.backends.cpu.get_cpu_capability()); other architectures are "default".
    """
    if not build._is_x86():
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
