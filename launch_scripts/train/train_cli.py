"""The training example's command line (train_gpt.py): the flags, their checks and
defaults (each optimizer's from train_optimizer.py)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from data import DataError, load_corpus
from gpt import PRESETS
from train_checkpoint import is_checkpoint
from train_optimizer import OPTIMIZERS

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


def offload_fraction(text: str) -> float | str:
    """``--offload``'s value: "auto" or a fraction in (0, 1]."""
    if text == "auto":
        return text
    value = _number(float, 0, inclusive=False)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] or 'auto', got {text}")
    return value


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
        "--offload",
        type=offload_fraction,
        nargs="?",
        const=1.0,
        default=None,
        metavar="FRACTION",
        help="keep masters and optimizer state in CPU memory (shardopt.CPUOffload): all of the "
        "shard, a FRACTION in (0, 1], or 'auto' (what does not fit on the GPU); docs/offload.md",
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
    if args.offload is not None and args.baseline == "ddp":
        parser.error("--offload offloads the ZeRO optimizer's state; not with --baseline ddp")
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
