"""Plots the JSON written by bench_train.py and bench_kernels.py for docs/benchmarks.md.

    python launch_scripts/bench/plot_benchmarks.py --train bench_train.json \
        --kernels bench_kernels.json --out docs/img
    python launch_scripts/bench/plot_benchmarks.py --scaling bench_train_w2.json \
        bench_train_w4.json bench_train_w8.json --out docs/img

``--scaling`` takes bench_train.py runs at several world sizes (weak scaling: same batch per GPU)
and prints a markdown table per mode (step ms, tokens/s per GPU, scaling efficiency against the
smallest world size, peak memory, the optimizer's persistent memory) and the collective bus
bandwidths, and plots tokens/s per GPU and efficiency against world size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pyplot():
    """matplotlib's pyplot on the Agg backend (imported late: the tables need no matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_train(path: Path, out: Path) -> Path:
    plt = _pyplot()
    data = json.loads(path.read_text())
    modes = {k: v for k, v in data["modes"].items() if "step_ms" in v}
    names = list(modes)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(
        axes,
        ("step_ms", "opt_ms", "peak_gib"),
        ("training step (ms, median)", "optimizer step (ms)", "peak memory per GPU (GiB)"),
    ):
        values = [modes[n][key] for n in names]
        colors = ["tab:blue" if n.startswith("shardopt") else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.invert_yaxis()
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    env = data["environment"]
    gpus = f"{env.get('device_count', '')}x {env.get('device_name', '')}"
    title = f"{data['model'].get('params', 0) / 1e9:.2f}B params, {gpus}, torch {env.get('torch')}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    target = out / "bench_train.png"
    fig.savefig(target, dpi=110)
    return target


def plot_kernels(path: Path, out: Path) -> Path:
    plt = _pyplot()
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r.get("ms") is not None and r["optimizer"] == "adam"]
    labels = [f"{r['set']} {r['dtype']} {r['impl']}" for r in rows]
    values = [r["of_copy"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(rows) + 1))
    colors = ["tab:blue" if r["impl"] == "shardopt" else "tab:gray" for r in rows]
    ax.barh(labels, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("Adam step, % of device copy bandwidth")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}%", va="center", fontsize=8)
    fig.tight_layout()
    target = out / "bench_kernels.png"
    fig.savefig(target, dpi=110)
    return target


def _load_runs(paths: list[Path]) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in paths]
    runs.sort(key=lambda r: r["environment"]["world_size"])
    worlds = [r["environment"]["world_size"] for r in runs]
    if len(set(worlds)) != len(worlds):
        raise SystemExit(f"--scaling needs one run per world size, got world sizes {worlds}")
    return runs


def scaling_rows(runs: list[dict]) -> list[dict]:
    """One row per (mode, world size); efficiency = tokens/s per GPU over the smallest world's."""
    base = runs[0]
    rows = []
    for run in runs:
        world = run["environment"]["world_size"]
        for mode, r in run["modes"].items():
            if "step_ms" not in r:
                continue
            per_gpu = r["tokens_per_s"] / world
            b = base["modes"].get(mode, {})
            base_per_gpu = b["tokens_per_s"] / base["environment"]["world_size"] if b else None
            rows.append(
                {
                    "mode": mode,
                    "world": world,
                    "step_ms": r["step_ms"],
                    "opt_ms": r["opt_ms"],
                    "tokens_per_gpu": per_gpu,
                    "efficiency": per_gpu / base_per_gpu if base_per_gpu else None,
                    "peak_gib": r.get("peak_gib"),
                    "optimizer_gib": sum(r["optimizer_gib"].values())
                    if r.get("optimizer_gib")
                    else None,
                }
            )
    return rows


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def scaling_table(runs: list[dict]) -> str:
    lines = [
        "| mode | GPUs | step ms | opt ms | tokens/s per GPU | efficiency | peak GiB | "
        "optimizer GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(scaling_rows(runs), key=lambda x: (x["mode"], x["world"])):
        lines.append(
            f"| {row['mode']} | {row['world']} | {row['step_ms']:.1f} | {row['opt_ms']:.2f} | "
            f"{row['tokens_per_gpu']:,.0f} | {_fmt(row['efficiency'], '.3f')} | "
            f"{_fmt(row['peak_gib'], '.2f')} | {_fmt(row['optimizer_gib'], '.2f')} |"
        )
    lines += [
        "",
        "| GPUs | collective | MB | RS bus GB/s | AG bus GB/s | RS / one call | AG / one call |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        world = run["environment"]["world_size"]
        colls = run.get("collectives", [])
        one = next((c for c in colls if "one call" in c["label"]), None)
        for c in colls:
            rs, ag = c.get("reduce_scatter_busbw_gbs"), c.get("all_gather_busbw_gbs")
            rs_share = rs / one["reduce_scatter_busbw_gbs"] if one and rs else None
            ag_share = ag / one["all_gather_busbw_gbs"] if one and ag else None
            lines.append(
                f"| {world} | {c['label']} | {c['bytes'] / 1e6:,.1f} | {_fmt(rs, '.1f')} | "
                f"{_fmt(ag, '.1f')} | {_fmt(rs_share, '.0%')} | {_fmt(ag_share, '.0%')} |"
            )
    return "\n".join(lines)


def plot_scaling(runs: list[dict], out: Path) -> Path:
    plt = _pyplot()
    rows = scaling_rows(runs)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        worlds = [r["world"] for r in mine]
        style = "-o" if mode.startswith("shardopt") else "--s"
        axes[0].plot(worlds, [r["tokens_per_gpu"] for r in mine], style, label=mode)
        axes[1].plot(worlds, [r["efficiency"] or 0 for r in mine], style, label=mode)
    axes[0].set_title("tokens/s per GPU (weak scaling)", fontsize=10)
    axes[1].set_title(f"efficiency vs {runs[0]['environment']['world_size']} GPUs", fontsize=10)
    for ax in axes:
        ax.set_xlabel("GPUs")
        ax.set_xticks(sorted({r["world"] for r in rows}))
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    target = out / "bench_scaling.png"
    fig.savefig(target, dpi=110)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=Path)
    parser.add_argument("--kernels", type=Path)
    parser.add_argument("--scaling", type=Path, nargs="+", help="bench_train runs, one per world")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.train:
        print(plot_train(args.train, args.out))
    if args.kernels:
        print(plot_kernels(args.kernels, args.out))
    if args.scaling:
        runs = _load_runs(args.scaling)
        print(scaling_table(runs))
        try:
            print(plot_scaling(runs, args.out))
        except ImportError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    main()
