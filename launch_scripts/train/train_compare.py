"""Quality of two optimizers on the training example: the same steps and tokens, each at the best
lr of a small sweep, both validation curves in one plot (docs/muon.md, "Quality").

Runs ``train_gpt.py`` under torchrun once per (optimizer, lr), every run with the same model,
data, seed, steps and batch, and reads each run's ``log.json``. Writes ``compare.json`` (every
run's final validation loss and curve), ``compare.md`` (the sweep as a table, with the corpus's
loss floor) and ``compare.png`` (the best run of each optimizer, and the floor) to ``--out-dir``.

    python launch_scripts/train/train_compare.py --optimizers adam muon \\
        --lrs 3e-3 1e-2 3e-2 --steps 1000 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", nargs="+", default=["adam", "muon"])
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-3, 1e-2, 3e-2])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=2, help="ranks (gloo on CPU, NCCL on GPUs)")
    p.add_argument("--out-dir", default="runs/compare")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("train_args", nargs="*", help="more train_gpt.py arguments, after --")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, optimizer: str, lr: float) -> dict:
    """One training run; its log.json."""
    out = Path(args.out_dir) / f"{optimizer}_lr{lr:g}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", str(HERE / "train_gpt.py"),
        "--optimizer", optimizer, "--lr", repr(lr), "--steps", str(args.steps),
        "--no-progress", "--out-dir", str(out), *args.train_args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                       timeout=args.timeout)  # fmt: skip
    return json.loads((out / "log.json").read_text())


def report(runs: dict[tuple[str, float], dict], out_dir: Path) -> dict[str, tuple[float, dict]]:
    """The table and the plot; the best (lr, log) of each optimizer."""
    first = next(iter(runs.values()))
    floor = first["loss_floor"]
    best: dict[str, tuple[float, dict]] = {}
    for (opt, lr), log in runs.items():
        if opt not in best or log["final"]["val_loss"] < best[opt][1]["final"]["val_loss"]:
            best[opt] = (lr, log)
    lrs = sorted({lr for _, lr in runs})
    opts = list(dict.fromkeys(opt for opt, _ in runs))
    rows = [
        f"corpus: {first['corpus']}; model {first['model_config']}; {first['world_size']} ranks; "
        f"{first['args']['steps']} steps of {first['tokens_per_step']:,} tokens; "
        f"loss floor {floor:.4f}",
        "",
        "| optimizer | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best - floor |",
        "|---|" + "---|" * (len(lrs) + 1),
    ]
    for opt in opts:
        cells = [
            f"{runs[(opt, lr)]['final']['val_loss']:.4f}" if (opt, lr) in runs else "-"
            for lr in lrs
        ]
        gap = best[opt][1]["final"]["val_loss"] - floor
        rows.append(f"| {opt} ({best[opt][1]['optimizer_class']}) | " + " | ".join(cells)
                    + f" | {gap:.4f} (lr {best[opt][0]:g}) |")  # fmt: skip
    (out_dir / "compare.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    summary = {
        f"{opt} lr {lr:g}": {"final_val": log["final"]["val_loss"], "val": log["history"]["val"]}
        for (opt, lr), log in runs.items()
    }
    (out_dir / "compare.json").write_text(json.dumps({"floor": floor, "runs": summary}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no compare.png (pip install 'shardopt[train]')")
        return best
    fig, ax = plt.subplots(figsize=(7, 4))
    for opt, (lr, log) in best.items():
        val = log["history"]["val"]
        ax.plot([v["step"] for v in val], [v["loss"] for v in val], label=f"{opt}, lr {lr:g}")
    ax.axhline(floor, color="gray", linestyle="--", label=f"loss floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=120)
    return best


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for opt in args.optimizers:
        for lr in args.lrs:
            runs[(opt, lr)] = run_one(args, opt, lr)
            print(f"{opt} lr {lr:g}: val {runs[(opt, lr)]['final']['val_loss']:.4f}", flush=True)
    report(runs, out_dir)


if __name__ == "__main__":
    main()
