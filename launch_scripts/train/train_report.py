"""What the training example reports (train_gpt.py): the run's setup, the banner, the progress
lines (a tqdm bar on a terminal, one line every --log-interval steps in a log file) and the
outputs (final_model.pt, log.json, loss.png)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from data import uniform_loss
from gpt import GPT
from train_step import Trainer


def layout(trainer: Trainer) -> dict[str, Any]:
    """Nodes, processes per node, and how the optimizer state is sharded and replicated."""
    env, optimizer = trainer.env, trainer.optimizer
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", max(1, env.world_size // env.local_world_size)))
    if trainer.args.baseline == "ddp":
        shard_size, replicas = 1, env.world_size  # every rank holds the whole state
    else:
        shard_size, replicas = optimizer.world_size, optimizer.redundant_size
    return {
        "nodes": nodes,
        "processes_per_node": env.local_world_size,
        "shard_size": shard_size,
        "replicas": replicas,
    }


def describe(trainer: Trainer) -> dict[str, Any]:
    """The run's setup, the head of log.json."""
    args, env, corpus = trainer.args, trainer.env, trainer.corpus
    return {
        "args": {k: v for k, v in vars(args).items() if k != "corpus"},
        "world_size": env.world_size,
        "layout": layout(trainer),
        "device": str(env.device),
        "backend": dist.get_backend(),
        "threads_per_rank": torch.get_num_threads(),
        "optimizer_class": type(trainer.optimizer).__name__,
        "model_config": dataclasses.asdict(trainer.config),
        "num_params": trainer.model.num_params(),
        "corpus": corpus.name,
        "loss_floor": corpus.loss_floor(args.block_size),
        "entropy_rate": corpus.entropies[-1] if corpus.entropies else None,
        "uniform_loss": uniform_loss(corpus.vocab_size),
        "tokens_per_step": env.world_size * args.grad_accum * args.batch_size * args.block_size,
        "resumed_from": trainer.resumed_from,
    }


def banner(log: dict[str, Any], start_step: int) -> str:
    floor, lay = "unknown", log["layout"]
    if log["loss_floor"] is not None:
        floor = f"{log['loss_floor']:.4f} (entropy rate {log['entropy_rate']:.4f})"
    lines = [
        f"{log['optimizer_class']} | {log['world_size']} rank(s), {log['backend']} on "
        f"{log['device']}, {log['threads_per_rank']} thread(s) per rank",
        f"{lay['nodes']} node(s) x {lay['processes_per_node']} process(es) | optimizer state "
        f"sharded over {lay['shard_size']} rank(s), {lay['replicas']} replica(s)",
        f"model {log['args']['model']}: {log['num_params']:,} params | data: {log['corpus']}",
        f"loss floor = {floor} nats/token | uniform guess = {log['uniform_loss']:.4f} | "
        f"{log['tokens_per_step']:,} tokens per step",
    ]
    if log["resumed_from"]:
        lines.append(f"resumed from {log['resumed_from']} at step {start_step}")
    return "\n".join(lines)


def save_outputs(out_dir: str, log: dict, model: GPT) -> str | None:
    """final_model.pt (the model's state dict), log.json and loss.png; returns why the plot was
    not drawn (matplotlib, of the ``train`` extra, is not installed), or None."""
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "final_model.pt"))
    with open(os.path.join(out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    try:
        import matplotlib
    except ImportError:
        return "loss.png not drawn: matplotlib is not installed (pip install 'shardopt[train]')"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    train, val = log["history"]["train"], log["history"]["val"]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val", ms=4)
    if log["loss_floor"] is not None:
        floor = log["loss_floor"]
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"loss floor {floor:.3f}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.set_title(f"{log['optimizer_class']}, {log['world_size']} rank(s), {log['args']['model']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)
    plt.close(fig)
    return None


class Progress:
    """The loop's progress on the main rank (other ranks print nothing).

    On a terminal (stderr a TTY, unless ``--no-progress``): a tqdm bar with the last logged loss,
    throughput, lr and val loss, and messages written above it. Otherwise (a log file, a pipe):
    no bar, whose redraws would add a line every few steps, but one line every ``--log-interval``
    steps and each message on its own line.
    """

    def __init__(self, main: bool, bar: bool, total: int, initial: int) -> None:
        self.main = main
        self.postfix: dict[str, str] = {}
        self.bar = None
        self.total = total
        if main and bar and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # log lines instead (tqdm is in the ``train`` extra)
                self.say("no progress bar: tqdm is not installed (pip install 'shardopt[train]')")
                return
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def say(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def logged(self, done: int, **values: str) -> None:
        """A log interval ended at step ``done`` with these values."""
        self.postfix.update(values)
        if self.bar is None:
            self.say(
                f"step {done}/{self.total}: "
                + " ".join(f"{k} {v}" for k, v in self.postfix.items())
            )

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
