"""Timing, memory and reporting helpers shared by bench_kernels.py and bench_train.py.

Times are medians in milliseconds: CUDA events around each repetition on a GPU (read after one
synchronize, so timing never adds a host sync inside the timed loop), ``time.perf_counter`` on the
CPU.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def import_shardopt():
    """``import shardopt``: the installed package if there is one, else the source tree."""
    try:
        import shardopt
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import shardopt
    return shardopt


class Interval:
    """Times repeated occurrences of one region: ``start()`` ... ``stop()``, then ``times_ms()``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []
        self._open: Any = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._marks.append((self._open, end))
        self._open = None

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self._marks]
        return [(e - s) * 1e3 for s, e in self._marks]

    def median_ms(self) -> float | None:
        times = self.times_ms()
        return statistics.median(times) if times else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 3,
    min_iters: int = 5,
    max_iters: int = 50,
    target_s: float = 1.0,
) -> list[float]:
    """Per-call times (ms) of ``fn`` after ``warmup`` calls; the count fits about ``target_s``."""
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(warmup):
        fn()
    synchronize(device)
    per_call = (time.perf_counter() - begin) / max(warmup, 1)
    iters = int(target_s / per_call) if per_call > 0 else max_iters
    iters = max(min_iters, min(max_iters, iters))
    timer = Interval(device)
    for _ in range(iters):
        timer.start()
        fn()
        timer.stop()
    return timer.times_ms()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def free_memory(device: torch.device) -> None:
    """Collects garbage, returns cached blocks to the driver and restarts the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def copy_bandwidth_gbs(device: torch.device, numel: int) -> dict[str, float]:
    """Device-to-device copy of ``numel`` fp32 elements: (bytes read + written) / median time."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, warmup=3, min_iters=10, max_iters=100)
    ms = median(times)
    nbytes = 2 * src.numel() * src.element_size()
    src = dst = None  # free both before the next measurement
    free_memory(device)
    return {"numel": numel, "bytes": nbytes, "ms": ms, "gbs": nbytes / ms / 1e6}


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, Any]:
    """Date, machine, versions and commit, for the record in docs/benchmarks.md."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "device": device.type,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["device_count"] = torch.cuda.device_count()
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: numbers right-aligned, None shown as '-'."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if abs(value) >= 100:
                return f"{value:,.1f}"
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    numeric = [
        all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        padded = zip(values, widths, numeric, strict=True)
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in padded).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Writes ``payload`` to ``path`` (atomically: a partial file never replaces a full one)."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(target)
