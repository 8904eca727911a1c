"""Train a small GPT with shardopt's ZeRO-sharded fused optimizers.

Run with torchrun (any number of processes; NCCL on GPUs, gloo on CPU) or with plain python::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train/train_gpt.py
    python launch_scripts/train/train_gpt.py --optimizer lamb --steps 200

By default the model trains with ``shardopt.DistributedFused<Optimizer>`` and no DDP: the
optimizer's gradient hooks reduce-scatter the gradients during backward, each rank updates its
shard, and the params are all-gathered back. ``--baseline ddp`` trains the same model with DDP and
the single-process ``shardopt.Fused<Optimizer>`` instead; both see the same data (see Note:
world-size-independent batches in data.py) and reach the same weights.

The default corpus is a synthetic Markov chain with a known entropy rate (data.py): the trainer
prints that loss floor next to the final train and validation loss.

The roles live beside it: train_cli.py (flags), train_env.py (processes), train_optimizer.py
(optimizer choices, optimizer, schedule), train_checkpoint.py, train_step.py (model, optimizer, one
step), train_report.py (banner, progress, outputs). This file is the training loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from train_cli import parse_args
from train_env import Env, init_distributed
from train_optimizer import learning_rate
from train_report import Progress, banner, describe, save_outputs
from train_step import Trainer

__all__ = ["main", "parse_args", "train"]


def train(args: argparse.Namespace, env: Env) -> dict[str, Any]:
    """Builds the trainer, runs the steps with logging, evals and checkpoints; returns the log."""
    trainer = Trainer.build(args, env)
    history = trainer.history
    log = describe(trainer)
    log["history"] = history
    if env.is_main:
        print(banner(log, trainer.start_step), flush=True)
    progress = Progress(env.is_main, not args.no_progress, args.steps, trainer.start_step)

    def run_eval(step: int) -> float:
        val = trainer.evaluate()
        history["val"].append({"step": step, "loss": val})
        progress.say(f"step {step}: val loss {val:.4f}")
        return val

    if trainer.start_step == 0:
        run_eval(0)
    loss_sum = torch.zeros((), device=env.device)
    steps_since_log, interval_time, train_time = 0, 0.0, 0.0
    for step in range(trainer.start_step, args.steps):
        if step == args.fail_at_step and env.rank == env.world_size - 1:
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
                print(f"rank {env.rank}: simulated failure before step {step}", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)  # a crash: no cleanup, the other ranks' collectives fail
        started = time.perf_counter()
        step_loss, grad_norm = trainer.train_step(step)
        loss_sum += step_loss
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        interval_time += time.perf_counter() - started
        steps_since_log += 1
        done = step + 1

        if done % args.log_interval == 0 or done == args.steps:
            dist.all_reduce(loss_sum)
            train_loss = loss_sum.item() / (steps_since_log * args.grad_accum * env.world_size)
            tokens_per_s = steps_since_log * log["tokens_per_step"] / interval_time
            lr = learning_rate(step, args)
            record = {"step": done, "loss": train_loss, "lr": lr, "tokens_per_s": tokens_per_s}
            if grad_norm is not None:
                record["grad_norm"] = grad_norm.item()
            history["train"].append(record)
            train_time += interval_time
            loss_sum.zero_()
            steps_since_log, interval_time = 0, 0.0
            progress.logged(
                done, loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}"
            )
        if done % args.eval_interval == 0 or done == args.steps:
            progress.postfix["val"] = f"{run_eval(done):.4f}"
        progress.advance()
        if args.ckpt_dir and (
            (args.ckpt_interval and done % args.ckpt_interval == 0) or done == args.steps
        ):
            trainer.save_checkpoint(done)
    progress.close()

    final_val = history["val"][-1]["loss"] if history["val"] else trainer.evaluate()
    final_train = history["train"][-1]["loss"] if history["train"] else float("nan")
    trained_tokens = (args.steps - trainer.start_step) * log["tokens_per_step"]
    log["final"] = {
        "train_loss": final_train,
        "val_loss": final_val,
        "train_time_s": train_time,
        "tokens_per_s": trained_tokens / train_time if train_time else None,
    }
    if env.is_main:
        floor = log["loss_floor"]
        gap = "" if floor is None else f" | floor {floor:.4f} (val - floor {final_val - floor:.4f})"
        print(
            f"final: train loss {final_train:.4f} | val loss {final_val:.4f}{gap} | "
            f"{log['final']['tokens_per_s'] or 0:,.0f} tokens/s"
        )
        missing = save_outputs(args.out_dir, log, trainer.model)
        print(f"wrote {args.out_dir}/{{final_model.pt,log.json{'' if missing else ',loss.png'}}}")
        if missing:
            print(missing)
    return log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = init_distributed(args.device, args.threads)
    try:
        train(args, env)
        dist.barrier()  # rank 0 writes the outputs; no rank tears gloo down under another
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
