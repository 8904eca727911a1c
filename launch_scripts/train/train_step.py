"""The training example's model, optimizer and one training step (train_gpt.py), built from
the flags and resumed from a checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from data import Corpus
from gpt import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel
from train_checkpoint import (
    checkpoint_path,
    find_checkpoint,
    read_checkpoint,
    save_checkpoint,
    sharded_checkpoint_module,
)
from train_env import Env
from train_optimizer import build_optimizer, learning_rate

# -- training -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Trainer:
    """The model, its optimizer and how to run one step, built from the flags (and a checkpoint)."""

    args: argparse.Namespace
    env: Env
    corpus: Corpus
    config: GPTConfig
    model: GPT
    optimizer: torch.optim.Optimizer
    forward: torch.nn.Module  # the module backward runs through: the DDP wrapper or the model
    no_sync: Callable[[], contextlib.AbstractContextManager]
    start_step: int = 0
    resumed_from: str | None = None
    history: dict[str, list] = dataclasses.field(default_factory=lambda: {"train": [], "val": []})

    @classmethod
    def build(cls, args: argparse.Namespace, env: Env) -> Trainer:
        corpus: Corpus = args.corpus
        config = GPTConfig.preset(
            args.model, vocab_size=corpus.vocab_size, block_size=args.block_size
        )
        torch.manual_seed(args.seed)
        model = GPT(config).to(env.device)
        resume_from = find_checkpoint(args) if args.resume else None
        meta = read_checkpoint(resume_from, args, config) if resume_from else None
        if meta is not None and meta["format"] == "full":
            # Before the optimizer exists, so the ZeRO optimizer's master copies start from it.
            model.load_state_dict(meta["model_state"])

        optimizer = build_optimizer(args, model)
        if args.baseline == "ddp":
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            ddp = DistributedDataParallel(model, device_ids=device_ids)
            trainer = cls(args, env, corpus, config, model, optimizer, ddp, ddp.no_sync)
        else:
            trainer = cls(args, env, corpus, config, model, optimizer, model, optimizer.no_sync)
        if meta is not None:
            trainer._restore(resume_from, meta)
        return trainer

    def _restore(self, folder: str, meta: dict) -> None:
        if meta["format"] == "sharded":
            sharded = sharded_checkpoint_module(self.optimizer)
            if sharded is None:
                raise SystemExit(
                    f"{folder} holds sharded ZeRO optimizer state: resume it without --baseline ddp"
                )
            sharded.load(os.path.join(folder, "shards"), self.optimizer, model=self.model)
        else:
            self.optimizer.load_state_dict(meta["optimizer_state"])
        torch.set_rng_state(meta["rng"])
        self.start_step, self.history, self.resumed_from = meta["step"], meta["history"], folder

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.env.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _batch(self, split: str, key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        a, env = self.args, self.env
        x, y = self.corpus.batch(split, key, a.batch_size, a.block_size, env.rank, env.world_size)
        return x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``grad_accum`` micro-batches.

        Returns:
            The sum of the micro-batch losses on this rank and the grad norm before clipping
            (None when not clipping here), both device tensors: no host sync.
        """
        args, optimizer = self.args, self.optimizer
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(args.grad_accum):
            x, y = self._batch("train", (args.seed, step, micro))
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else self.no_sync():
                with self.autocast():
                    _, loss = self.forward(x, y)
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float()
        grad_norm = None
        if args.clip > 0 and args.optimizer != "lamb":
            if args.baseline == "ddp":
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)
            else:
                grad_norm = optimizer.clip_grad_norm(args.clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss_sum, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over ``eval_iters`` batches per rank, the same batches every time."""
        total = torch.zeros((), device=self.env.device)
        for it in range(self.args.eval_iters):
            x, y = self._batch("val", (self.args.seed, it))
            with self.autocast():
                _, loss = self.model(x, y)
            total += loss.float()
        dist.all_reduce(total)
        return total.item() / (self.args.eval_iters * self.env.world_size)

    def save_checkpoint(self, step: int) -> None:
        trainer_state = {
            "optimizer": self.args.optimizer,
            "model_config": dataclasses.asdict(self.config),
            "history": self.history,
        }
        folder = checkpoint_path(self.args, step)
        save_checkpoint(folder, step, self.model, self.optimizer, trainer_state, self.env)
