"""bench_offload.py --largest: the largest GPT that trains, per contender, found by attempts.

At one width, depths go up by ``step`` from ``start`` while attempts succeed (down by ``step``
while they fail, if the first one fails), then the gap between the last success and the first
failure is bisected down to ``resolution`` blocks. Each attempt is one worker subprocess
(bench_offload_worker.py) training a few steps of that model, so a GPU OOM, a host OOM kill or a
timeout ends the attempt, never the search. The searches share one time budget: each search gets
an equal part of what is left when it starts, and an attempt is started only if its timeout fits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from bench_offload_report import billions
from bench_offload_worker import Spec

GIB = 2**30
#: seconds an attempt needs at the least (process start, model build, one step)
MIN_ATTEMPT_S = 30.0


def trained(record: dict[str, Any]) -> bool:
    """Whether the attempt trained all its steps."""
    phases = record.get("phases") or []
    return bool(phases) and all("step_ms" in p for p in phases) and "error" not in record


def search(
    base: Spec,
    run: Callable[[Spec, float], dict[str, Any]],
    *,
    start: int,
    step: int,
    max_depth: int,
    resolution: int,
    deadline: float,
    attempt_timeout_s: float,
) -> dict[str, Any]:
    """The largest depth of ``base.contender`` at ``base.width`` that trains, within ``deadline``
    (a ``time.monotonic()`` value); ``run(spec, timeout_s)`` measures one attempt."""
    attempts: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    failed: dict[str, Any] | None = None

    def attempt(depth: int) -> bool | None:
        """True/False: trained or not; None: no time left for it."""
        nonlocal best, failed
        left = deadline - time.monotonic()
        if left < MIN_ATTEMPT_S:
            return None
        record = run(dataclasses.replace(base, depth=depth), min(attempt_timeout_s, left))
        ok = trained(record)
        summary = {
            "depth": depth,
            "params": record.get("params"),
            "trained": ok,
            "why": None if ok else record.get("error") or record.get("skipped"),
            "step_ms": record["phases"][-1]["step_ms"] if ok else None,
            "gpu_peak_gib": record.get("gpu_peak_gib"),
            "host_peak_rss_gib": record.get("host_peak_rss_gib"),
            "host_bytes_per_param": record.get("host_bytes_per_param"),
        }
        attempts.append(summary)
        print(
            f"  {base.contender} width {base.width} depth {depth} "
            f"({billions(summary['params'] or 0)}): "
            + ("trained" if ok else f"failed: {summary['why']}"),
            flush=True,
        )
        if "skipped" in record:  # the contender cannot run at all: no point in searching
            failed = summary
            raise StopIteration
        if ok and (best is None or depth > best["depth"]):
            best = summary
        if not ok and (failed is None or depth < failed["depth"]):
            failed = summary
        return ok

    stopped = None
    try:
        depth = start
        first = attempt(depth)
        if first is None:
            stopped = "time budget spent before the first attempt"
        elif first:
            while True:
                if depth + step > max_depth:
                    stopped = f"trained up to the depth limit ({max_depth} blocks)"
                    break
                depth += step
                got = attempt(depth)
                if got is None:
                    stopped = "time budget spent while going up"
                    break
                if not got:
                    break
        else:
            while depth - step >= 1:
                depth -= step
                got = attempt(depth)
                if got is None:
                    stopped = "time budget spent while going down"
                    break
                if got:
                    break
        while stopped is None and best is not None and failed is not None:
            low, high = best["depth"], failed["depth"]
            if high - low <= resolution:
                break
            middle = (low + high) // 2
            if attempt(middle) is None:
                stopped = "time budget spent while bisecting"
    except StopIteration:
        stopped = "skipped"
    return {
        "contender": base.contender,
        "width": base.width,
        "largest": best,
        "first_failure": failed,
        "stopped": stopped,
        "attempts": attempts,
    }
