"""The markdown tables and the target lines of bench_muon.py, read off its rows."""

from __future__ import annotations

from typing import Any

#: issue 46's step targets: (set, contender, FusedMuon time over torch.optim.Muon + fused AdamW)
STEP_TARGETS = (
    ("gpt124m", "fused", 0.4),
    ("gpt1.3b", "fused", 0.9),
    ("gpt1.3b", "fused_gram", 0.7),
    ("gpt1.3b", "fused_gram16", 0.7),
)
#: Newton-Schulz over the bf16 GEMM rate measured in the same run
NS_TARGET = 0.8
PEERS = (
    "emerging",
    "emerging_syrk",
    "heavyball",
    "heavyball_default",
    "heavyball_eager",
    "deepspeed",
)


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:.{digits}f}"


def _sci(value: Any) -> str:
    return "-" if value is None else f"{value:.1e}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(result: dict[str, Any]) -> str:
    """The run's environment line, the step table and the Newton-Schulz table."""
    env = result["environment"]
    rows = result["rows"]
    versions = env.get("versions", {})
    out = [
        f"{env['date']}, {env['device_name']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"commit {env['commit']}; FusedMuon Gram option: {env.get('fused_gram_option')}",
        "",
        "| set | contender | version | ms | time / torch's | param change | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("kind") != "step":
            continue
        note = r.get("error", "")
        if r.get("moved") == 0:
            note = "the Muon params did not change: not a Muon step"
        elif "timed" in r:
            note = f"{r['timed']}; step {_num(r.get('step_ms'))} ms, {r.get('adamw')}"
        out.append(
            f"| {r['set']} | {r['contender']} | {versions.get(r['contender']) or '-'} | "
            f"{_num(r.get('ms'))} | {_num(r.get('vs_torch'))} | {_sci(r.get('moved'))} | {note} |"
        )
    out += [
        "",
        "| set | Newton-Schulz | ms | TFLOP/s | of mm GEMM | of same-shape bmm | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("kind") == "gemm":
            out.append(
                f"| - | {r['what']} (bf16 GEMM ceiling) | {_num(r.get('ms'))} | "
                f"{_num(r.get('tflops'), 1)} | - | - | {r.get('error', '')} |"
            )
        elif r.get("kind") == "ns":
            out.append(
                f"| {r['set']} | {r.get('what', '-')} | {_num(r.get('ms'))} | "
                f"{_num(r.get('tflops'), 1)} | {_pct(r.get('of_gemm'))} | "
                f"{_pct(r.get('of_gemm_same_shapes'))} | {r.get('error', '')} |"
            )
    return "\n".join(out)


def _ms(rows: list[dict[str, Any]], set_name: str, contender: str) -> float | None:
    for r in rows:
        if r.get("kind") == "step" and r["set"] == set_name and r["contender"] == contender:
            return r.get("ms")
    return None


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target of issue 46 that this run measured, met or not."""
    lines = []
    for set_name, contender, target in STEP_TARGETS:
        ms, base = _ms(rows, set_name, contender), _ms(rows, set_name, "torch")
        if ms and base:
            ratio = ms / base
            verdict = "met" if ratio <= target else "not met"
            lines.append(
                f"{set_name} {contender}: {ratio:.3f}x torch.optim.Muon + fused AdamW "
                f"(target <= {target}x): {verdict}"
            )
    for set_name in dict.fromkeys(r["set"] for r in rows if r.get("kind") == "step"):
        ms = _ms(rows, set_name, "fused")
        peers = {p: _ms(rows, set_name, p) for p in PEERS}
        peers = {p: v for p, v in peers.items() if v}
        if ms and peers:
            best = min(peers, key=peers.get)
            verdict = "ahead of" if ms < peers[best] else "behind"
            lines.append(
                f"{set_name} fused: {ms:.3f} ms, {verdict} the fastest peer ({best}, "
                f"{peers[best]:.3f} ms)"
            )
    for r in rows:
        if r.get("kind") == "ns" and r.get("what") == "shardopt_batched" and r.get("of_gemm"):
            verdict = "met" if r["of_gemm"] >= NS_TARGET else "not met"
            lines.append(
                f"{r['set']} Newton-Schulz: {100 * r['of_gemm']:.1f}% of the GEMM rate "
                f"(target >= {100 * NS_TARGET:.0f}%): {verdict}"
            )
    return lines
