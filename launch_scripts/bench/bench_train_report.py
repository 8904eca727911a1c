"""bench_train.py's tables: modes side by side and the collectives."""

from __future__ import annotations

from typing import Any

from bench_common import (
    format_table,
)

# -- report ---------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_table(modes: dict[str, dict[str, Any]]) -> str:
    ddp = modes.get("ddp_adamw", {})
    fsdp = modes.get("fsdp2", {})
    floor = modes.get("compute_floor", {}).get("step_ms")
    headers = [
        "mode",
        "step ms",
        "over floor ms",
        "over/ddp's",
        "opt ms",
        "peak GiB",
        "tokens/s",
        "step/ddp",
        "step/fsdp2",
        "opt/ddp",
        "mem/ddp",
        "mem/fsdp2",
    ]
    rows = []
    for name, r in modes.items():
        if "error" in r:
            continue
        over = r["step_ms"] - floor if floor is not None else None
        ddp_over = ddp["step_ms"] - floor if floor is not None and "step_ms" in ddp else None
        rows.append(
            [
                name,
                r["step_ms"],
                over,
                ratio(over, ddp_over),
                r["opt_ms"],
                r.get("peak_gib"),
                r["tokens_per_s"],
                ratio(r["step_ms"], ddp.get("step_ms")),
                ratio(r["step_ms"], fsdp.get("step_ms")),
                ratio(r["opt_ms"], ddp.get("opt_ms")),
                ratio(r.get("peak_gib"), ddp.get("peak_gib")),
                ratio(r.get("peak_gib"), fsdp.get("peak_gib")),
            ]
        )
    text = format_table(headers, rows)
    failed = [f"  {name}: {r['error']}" for name, r in modes.items() if "error" in r]
    if failed:
        text += "\nfailed:\n" + "\n".join(failed)
    return text


def collective_table(collectives: list[dict[str, Any]]) -> str:
    headers = ["size", "MB", "reduce-scatter ms", "RS busbw GB/s", "all-gather ms", "AG busbw GB/s"]
    rows = [
        [
            c["label"],
            c["bytes"] / 1e6,
            c["reduce_scatter_ms"],
            c["reduce_scatter_busbw_gbs"],
            c["all_gather_ms"],
            c["all_gather_busbw_gbs"],
        ]
        for c in collectives
    ]
    return format_table(headers, rows)
