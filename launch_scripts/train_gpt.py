"""Train a small GPT with shardopt's ZeRO-sharded fused optimizers.

Run with torchrun (any number of processes; NCCL on GPUs, gloo on CPU) or with plain python::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train_gpt.py
    python launch_scripts/train_gpt.py --optimizer lamb --steps 200

By default the model trains with ``shardopt.DistributedFused<Optimizer>`` and no DDP: the
optimizer's gradient hooks reduce-scatter the gradients during backward, each rank updates its
shard, and the params are all-gathered back. ``--baseline ddp`` trains the same model with DDP and
the single-process ``shardopt.Fused<Optimizer>`` instead; both see the same data (see Note:
world-size-independent batches in data.py) and reach the same weights.

The default corpus is a synthetic Markov chain with a known entropy rate (data.py): the trainer
prints that loss floor next to the final train and validation loss.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from data import Corpus, DataError, load_corpus, uniform_loss
from gpt import GPT, PRESETS, GPTConfig
from torch.nn.parallel import DistributedDataParallel

import shardopt


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A shardopt optimizer family and the defaults that train the tiny model well."""

    class_name: str  # the single-process class; the ZeRO class is "Distributed" + class_name
    lr: float
    weight_decay: float
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


OPTIMIZERS = {
    "adam": OptimizerSpec("FusedAdam", lr=1e-2, weight_decay=0.1, kwargs={"betas": (0.9, 0.95)}),
    "lamb": OptimizerSpec("FusedLAMB", lr=1e-2, weight_decay=0.01),
    "novograd": OptimizerSpec(
        "FusedNovoGrad", lr=0.3, weight_decay=1e-3, kwargs={"betas": (0.95, 0.98)}
    ),
    "sgd": OptimizerSpec("FusedSGD", lr=0.3, weight_decay=0.0, kwargs={"momentum": 0.9}),
    "adagrad": OptimizerSpec("FusedAdagrad", lr=3e-2, weight_decay=0.0),
}


# -- command line ---------------------------------------------------------------------------------


def _number(kind: type, low: float, inclusive: bool) -> Callable[[str], Any]:
    bound = f">= {low}" if inclusive else f"> {low}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = _number(int, 0, inclusive=False)
nonnegative_int = _number(int, 0, inclusive=True)
positive_float = _number(float, 0.0, inclusive=False)
nonnegative_float = _number(float, 0.0, inclusive=True)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter
    )
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="update rule")
    g.add_argument(
        "--baseline",
        choices=["ddp"],
        default=None,
        help="train with DDP + the single-process Fused optimizer instead of the ZeRO optimizer",
    )
    per_optimizer = ", ".join(f"{n} {s.lr:g}" for n, s in OPTIMIZERS.items())
    g.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"peak lr (default per optimizer: {per_optimizer})",
    )
    per_optimizer = ", ".join(f"{n} {s.weight_decay:g}" for n, s in OPTIMIZERS.items())
    g.add_argument(
        "--weight-decay",
        type=nonnegative_float,
        default=None,
        help=f"on matrices and embeddings (default per optimizer: {per_optimizer})",
    )
    g.add_argument(
        "--clip",
        type=nonnegative_float,
        default=1.0,
        help="max global grad norm, 0 = off (LAMB clips inside the optimizer)",
    )
    g.add_argument(
        "--lr-schedule", choices=["constant", "cosine"], default="cosine", help="after warmup"
    )
    g.add_argument("--warmup", type=nonnegative_int, default=20, help="linear warmup steps")
    g.add_argument(
        "--state-format",
        choices=["fp32", "bf16", "fp16", "scaled_fp16", "int8"],
        default=None,
        help="how DistributedFusedAdam stores its moments (default fp32; docs/api.md)",
    )
    g.add_argument(
        "--hsdp",
        action="store_true",
        help="HSDP: shard the optimizer within groups of --shard-size consecutive ranks (a node), "
        "replicate it across them (shardopt.zero.hsdp_groups)",
    )
    g.add_argument(
        "--shard-size",
        type=positive_int,
        default=None,
        help="ranks per shard group with --hsdp (default: LOCAL_WORLD_SIZE, processes per node)",
    )

    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=list(PRESETS), default="tiny", help="model preset")
    g.add_argument("--block-size", type=positive_int, default=None, help="(default: the preset's)")
    g.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank")
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step")
    g.add_argument(
        "--data",
        default=None,
        help="text file (character level) or nanoGPT uint16 .bin token file "
        "(default: the embedded synthetic corpus)",
    )
    g.add_argument("--seed", type=int, default=0, help="model init and batch sampling")

    g = p.add_argument_group("run")
    g.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps")
    g.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if available"
    )
    g.add_argument("--eval-interval", type=positive_int, default=250, help="steps between evals")
    g.add_argument("--eval-iters", type=positive_int, default=10, help="val batches per rank")
    g.add_argument(
        "--log-interval", type=positive_int, default=10, help="steps between train-loss records"
    )
    g.add_argument("--ckpt-dir", default=None, help="folder of checkpoints (step_NNNNNN/)")
    g.add_argument(
        "--ckpt-interval",
        type=nonnegative_int,
        default=0,
        help="steps between checkpoints, 0 = off",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="CKPT",
        help="resume from a checkpoint folder, or (no value) from the latest one in --ckpt-dir",
    )
    g.add_argument("--out-dir", default="runs/train_gpt", help="log.json, loss.png, final_model.pt")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="intra-op threads per rank on CPU (default: the cores / LOCAL_WORLD_SIZE)",
    )
    g.add_argument(
        "--fail-at-step",
        type=nonnegative_int,
        default=None,
        metavar="STEP",
        help="testing restarts: the last rank exits with an error before step STEP (0-based) "
        "while TORCHELASTIC_RESTART_COUNT is 0 or unset",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ckpt_interval and args.ckpt_dir is None:
        parser.error("--ckpt-interval needs --ckpt-dir")
    if args.resume == "latest" and args.ckpt_dir is None:
        parser.error("--resume without a path needs --ckpt-dir")
    if args.resume not in (None, "latest") and not is_checkpoint(args.resume):
        parser.error(f"--resume {args.resume}: not a complete checkpoint folder")
    if args.hsdp and args.baseline == "ddp":
        parser.error("--hsdp shards the ZeRO optimizer; it does not apply to --baseline ddp")
    if args.state_format not in (None, "fp32") and (
        args.baseline == "ddp" or args.optimizer != "adam"
    ):
        parser.error("--state-format applies to the ZeRO Adam optimizer (--optimizer adam)")
    if args.shard_size is not None and not args.hsdp:
        parser.error("--shard-size needs --hsdp")
    if args.hsdp and args.shard_size is None and "LOCAL_WORLD_SIZE" not in os.environ:
        parser.error("--hsdp takes the shard size from torchrun's LOCAL_WORLD_SIZE: run under "
                     "torchrun or pass --shard-size")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    spec = OPTIMIZERS[args.optimizer]
    args.lr = spec.lr if args.lr is None else args.lr
    args.weight_decay = spec.weight_decay if args.weight_decay is None else args.weight_decay
    args.block_size = args.block_size or PRESETS[args.model]["block_size"]
    try:
        corpus = load_corpus(args.data)
        corpus.check_block_size(args.block_size)
    except DataError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            parser.error(str(e))
        sys.exit(2)
    args.corpus = corpus
    return args


# -- distributed setup ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Env:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str, threads: int | None = None) -> Env:
    """Initialises the process group: NCCL + cuda:LOCAL_RANK on GPUs, gloo on CPU.

    Without torchrun (plain ``python``) it is a group of one on an in-memory store. On CPU each
    rank uses ``threads`` intra-op threads (None: its share of the cores of this node).
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        backend = "nccl"
    else:
        device = torch.device("cpu")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(threads or max(1, (cpus or 1) // local_world_size))
        backend = "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Env(rank, world_size, local_rank, local_world_size, device)


# -- optimizer, schedule --------------------------------------------------------------------------


def build_optimizer(args: argparse.Namespace, model: GPT) -> torch.optim.Optimizer:
    """The ZeRO optimizer, or with ``--baseline ddp`` the single-process one.

    With ``--hsdp`` the ZeRO optimizer shards within groups of ``--shard-size`` consecutive ranks
    (default: the processes of one node) and replicates across them.
    """
    spec = OPTIMIZERS[args.optimizer]
    kwargs = dict(spec.kwargs, lr=args.lr)
    if args.optimizer == "lamb":
        kwargs["max_grad_norm"] = args.clip  # LAMB clips the global norm itself (0 = off)
    groups = model.param_groups(args.weight_decay)
    if args.baseline == "ddp":
        return getattr(shardopt, spec.class_name)(groups, **kwargs)
    name = "Distributed" + spec.class_name
    if not hasattr(shardopt, name):
        raise SystemExit(f"this shardopt has no {name}; run with --baseline ddp")
    if args.state_format is not None:
        kwargs["state_format"] = args.state_format
    if args.hsdp:
        from shardopt.zero import hsdp_groups

        kwargs.update(hsdp_groups(args.shard_size)._asdict())
    return getattr(shardopt, name)(groups, **kwargs)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then constant or cosine decay to lr/10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = args.lr / 10
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (args.lr - min_lr)


# -- checkpoints ----------------------------------------------------------------------------------

TRAINER_FILE = "trainer.pt"  # written last: its presence marks a complete checkpoint


def sharded_checkpoint_module(optimizer: torch.optim.Optimizer) -> ModuleType | None:
    """``shardopt.checkpoint`` when it exists and the optimizer is a ZeRO one, else None."""
    if not type(optimizer).__name__.startswith("Distributed"):
        return None
    try:
        module = importlib.import_module("shardopt.checkpoint")
    except ImportError:
        return None
    return module if hasattr(module, "save") and hasattr(module, "load") else None


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    folder: str,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    env: Env,
) -> None:
    """Writes checkpoint ``folder`` (collective: every rank calls it).

    With ``shardopt.checkpoint`` every rank writes its own optimizer shards (and rank 0 the model)
    under ``folder/shards``; otherwise rank 0 writes the full model and optimizer state dicts into
    ``trainer.pt``. ``trainer.pt`` is written last, by atomic rename, and removed first, so a
    crash mid-save never leaves a folder that looks complete.
    """
    marker = os.path.join(folder, TRAINER_FILE)
    if env.is_main:
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(marker):
            os.remove(marker)
    dist.barrier()
    sharded = sharded_checkpoint_module(optimizer)
    meta = dict(trainer_state, step=step, rng=torch.get_rng_state())
    if sharded is not None:
        sharded.save(os.path.join(folder, "shards"), optimizer, model=model, overwrite=True)
        meta["format"] = "sharded"
    else:
        meta["optimizer_state"] = optimizer.state_dict()  # may gather shards: every rank calls it
        meta["model_state"] = model.state_dict()
        meta["format"] = "full"
    dist.barrier()
    if env.is_main:
        _atomic_save(meta, marker)
    dist.barrier()


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TRAINER_FILE))


def find_checkpoint(args: argparse.Namespace) -> str | None:
    """The folder ``--resume`` names; for ``latest``, the newest complete one (None if none)."""
    if args.resume != "latest":
        return args.resume
    if not os.path.isdir(args.ckpt_dir):
        return None
    steps = [
        int(name.removeprefix("step_"))
        for name in os.listdir(args.ckpt_dir)
        if name.startswith("step_") and is_checkpoint(os.path.join(args.ckpt_dir, name))
    ]
    return checkpoint_path(args, max(steps)) if steps else None


def read_checkpoint(folder: str, args: argparse.Namespace, config: GPTConfig) -> dict:
    meta = torch.load(os.path.join(folder, TRAINER_FILE), map_location="cpu", weights_only=True)
    expected = {"optimizer": args.optimizer, "model_config": dataclasses.asdict(config)}
    for key, value in expected.items():
        if meta[key] != value:
            raise SystemExit(f"checkpoint {folder} has {key}={meta[key]}, this run {value}")
    return meta


def checkpoint_path(args: argparse.Namespace, step: int) -> str:
    return os.path.join(args.ckpt_dir, f"step_{step:06d}")


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


def save_outputs(out_dir: str, log: dict, model: GPT) -> None:
    """final_model.pt (the model's state dict), log.json and loss.png."""
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "final_model.pt"))
    with open(os.path.join(out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    import matplotlib

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


def train(args: argparse.Namespace, env: Env) -> dict[str, Any]:
    """Builds the trainer, runs the steps with logging, evals and checkpoints; returns the log."""
    trainer = Trainer.build(args, env)
    history = trainer.history
    log = describe(trainer)
    log["history"] = history
    say = print
    bar = None
    if env.is_main:
        print(banner(log, trainer.start_step), flush=True)
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=args.steps, initial=trainer.start_step, unit="step", dynamic_ncols=True
            )
            say = bar.write

    def run_eval(step: int) -> float:
        val = trainer.evaluate()
        history["val"].append({"step": step, "loss": val})
        if env.is_main:
            say(f"step {step}: val loss {val:.4f}")
        return val

    if trainer.start_step == 0:
        run_eval(0)
    loss_sum = torch.zeros((), device=env.device)
    steps_since_log, interval_time, train_time = 0, 0.0, 0.0
    postfix: dict[str, str] = {}
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
            postfix.update(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}")
            if bar is None and env.is_main:
                say(
                    f"step {done}/{args.steps}: " + " ".join(f"{k} {v}" for k, v in postfix.items())
                )
        if done % args.eval_interval == 0 or done == args.steps:
            postfix["val"] = f"{run_eval(done):.4f}"
        if bar is not None:
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
        if args.ckpt_dir and (
            (args.ckpt_interval and done % args.ckpt_interval == 0) or done == args.steps
        ):
            trainer.save_checkpoint(done)
    if bar is not None:
        bar.close()

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
        save_outputs(args.out_dir, log, trainer.model)
        print(f"wrote {args.out_dir}/{{final_model.pt,log.json,loss.png}}")
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
