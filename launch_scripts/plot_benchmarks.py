"""Plots the JSON written by bench_train.py and bench_kernels.py for docs/benchmarks.md.

    python launch_scripts/plot_benchmarks.py --train bench_train.json --kernels bench_kernels.json \
        --out docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_train(path: Path, out: Path) -> Path:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=Path)
    parser.add_argument("--kernels", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.train:
        print(plot_train(args.train, args.out))
    if args.kernels:
        print(plot_kernels(args.kernels, args.out))


if __name__ == "__main__":
    main()
