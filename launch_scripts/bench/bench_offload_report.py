"""bench_offload.py's report: the markdown tables and the target lines, from the records.

A record is what bench_offload_worker.py returns for one contender (``phases`` per clip setting
with ``step_ms``; or ``skipped`` / ``error``); a search result is bench_offload_search.py's.
"""

from __future__ import annotations

from typing import Any

from bench_offload_peers import TIMING_ONLY


def one_line(record: dict[str, Any]) -> str:
    """A contender's outcome in one line: its steps and memory, or why it did not run."""
    if "skipped" in record:
        return f"skipped: {record['skipped']}"
    if "error" in record:
        return f"FAILED {record['error']}"
    parts = []
    for p in record["phases"]:
        label = "clip" if p["clip"] else "no clip"
        parts.append(f"{label} {p['step_ms']:.1f} ms" if "step_ms" in p else f"{label} skipped")
    labels = {"gpu_peak_gib": "GPU peak", "host_peak_rss_gib": "host RSS peak"}
    mem = [f"{label} {record[k]:.1f} GiB" for k, label in labels.items() if k in record]
    return ", ".join(parts + mem)


def _last_step_peak(record: dict, clip: bool) -> float | None:
    """The GPU peak of the last timed step of ``record``'s phase with ``clip`` (None: absent)."""
    for phase in record.get("phases", []):
        if phase.get("clip") == clip:
            return phase.get("gpu_peak_last_step_gib")
    return None


def step_ms(records: dict[str, Any], name: str, clip: bool) -> float | None:
    """Contender ``name``'s median step at the clip setting ``clip``, if it ran."""
    for p in records.get(name, {}).get("phases", []):
        if p.get("clip") == clip and "step_ms" in p:
            return p["step_ms"]
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(records: dict[str, Any]) -> str:
    """The markdown table of one size: a row per contender and clip setting."""
    headers = [
        "contender", "clip", "step ms", "vs no offload", "vs DeepSpeed offload",
        "GPU peak GiB", "host RSS GiB", "host B/param", "tokens/s",
    ]  # fmt: skip
    rows = []
    for name, r in records.items():
        for p in r.get("phases", []):
            if "step_ms" not in p:
                continue
            clip = p["clip"]
            rows.append(
                [
                    name,
                    "-" if name in TIMING_ONLY else ("on" if clip else "off"),
                    p["step_ms"],
                    ratio(p["step_ms"], step_ms(records, "no_offload", clip)),
                    ratio(p["step_ms"], step_ms(records, "deepspeed_offload", clip)),
                    r.get("gpu_peak_gib"),
                    r.get("host_peak_rss_gib"),
                    r.get("host_bytes_per_param"),
                    None if name in TIMING_ONLY else p.get("tokens_per_s"),
                ]
            )
    text = markdown(headers, rows)
    notes = []
    for name, r in records.items():
        if "skipped" in r or "error" in r:
            notes.append(
                f"- {name}: "
                + (f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}")
            )
        notes += [
            f"- {name} (clip): skipped: {p['skipped']}"
            for p in r.get("phases", [])
            if "skipped" in p
        ]
    return text + ("\n" + "\n".join(notes) if notes else "")


def full_offload_target(records: dict[str, Any]) -> dict[str, Any]:
    """Step of each offload contender against 1.1x max(forward+backward, CPU update), and full
    offload against DeepSpeed's offload with clipping."""
    fwd_bwd = step_ms(records, "fwd_bwd", False)
    update = step_ms(records, "cpu_update", False)
    floor = max(fwd_bwd, update) if fwd_bwd is not None and update is not None else None
    out: dict[str, Any] = {"fwd_bwd_ms": fwd_bwd, "cpu_update_ms": update, "floor_ms": floor}
    lines = []
    if floor is not None:
        lines.append(
            f"max(forward+backward {fwd_bwd:.1f} ms, CPU update {update:.1f} ms) = {floor:.1f} ms"
        )
    for name in ("offload", "offload_auto", "offload_compact"):
        for clip in (False, True):
            ms = step_ms(records, name, clip)
            if ms is None or floor is None:
                continue
            out[f"{name}_clip{int(clip)}_over_floor"] = ms / floor
            lines.append(
                f"{name} (clip {'on' if clip else 'off'}): {ms:.1f} ms = {ms / floor:.2f}x that"
                + (" (target without clipping: <= 1.1x)" if name == "offload" and not clip else "")
            )
    base, auto = records.get("no_offload", {}), records.get("offload_auto", {})
    for clip in (False, True):
        ms, ref = step_ms(records, "offload_auto", clip), step_ms(records, "no_offload", clip)
        if ms is None or ref is None:
            continue
        out[f"auto_clip{int(clip)}_over_no_offload"] = ms / ref
        saved = ""
        steady = [_last_step_peak(r, clip) for r in (auto, base)]
        if None not in steady:
            saved = (
                f", the last timed step's GPU peak {steady[0]:.1f} GiB against "
                f"{steady[1]:.1f} ({steady[1] - steady[0]:.1f} GiB saved)"
            )
        gib = auto.get("offload_plan", {}).get("device_bytes_saved")
        if gib is not None:
            saved += f"; state moved to the host {gib / 2**30:.1f} GiB"
        lines.append(
            f"offload_auto (clip {'on' if clip else 'off'}): {ms / ref:.2f}x no_offload's step "
            f"(target on a model that fits: <= 1.1x){saved}"
        )
    targets = {"offload": "<= 12.5", "offload_compact": "<= 4.5", "deepspeed_offload": None}
    # what a training process adds without offload (the CUDA libraries its first forward and
    # backward load, ...): the part of a contender's host memory that is not its optimizer's
    plain = records.get("no_offload", {}).get("host_bytes_per_param")
    for name, target in targets.items():
        per_param = records.get(name, {}).get("host_bytes_per_param")
        if per_param is not None:
            out[f"{name}_host_bytes_per_param"] = per_param
            above = ""
            if plain is not None:
                out[f"{name}_host_bytes_per_param_over_no_offload"] = per_param - plain
                above = f"; {per_param - plain:.2f} above no_offload's ({plain:.2f})"
            lines.append(
                f"{name}: host memory {per_param:.2f} B/param above the process's baseline"
                + (f" (target {target})" if target else "")
                + above
            )
    ds = step_ms(records, "deepspeed_offload", True)
    ours = step_ms(records, "offload", True)
    if ds is not None and ours is not None:
        out["offload_over_deepspeed_clip"] = ours / ds
        lines.append(
            f"offload / DeepSpeed offload, clipping on: {ours / ds:.2f}x (target <= 0.45x)"
        )
    out["lines"] = lines
    return out


def largest_table(results: list[dict[str, Any]]) -> str:
    """Markdown rows: the largest model each contender trained and the smallest that failed."""
    headers = [
        "contender",
        "width",
        "largest trained",
        "params",
        "step ms",
        "GPU peak GiB",
        "host RSS GiB",
        "host B/param",
        "first failure",
    ]
    rows = []
    for r in results:
        best, fail = r.get("largest") or {}, r.get("first_failure") or {}
        rows.append(
            [
                r["contender"],
                r["width"],
                f"{best['depth']} blocks" if best else "none",
                billions(best["params"]) if best else "-",
                best.get("step_ms"),
                best.get("gpu_peak_gib"),
                best.get("host_peak_rss_gib"),
                best.get("host_bytes_per_param"),
                f"{fail['depth']} blocks ({billions(fail['params'])}): {fail['why']}"
                if fail and fail.get("params")
                else (r.get("stopped") or "-"),
            ]
        )
    return markdown(headers, rows)


def billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table: floats to 3 significant places at most, None as '-'."""
    cells = [[_cell(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)
