"""Sharded checkpoint save/load speed and memory on the benchmark GPT.

    torchrun --standalone --nproc-per-node 2 launch_scripts/bench/bench_checkpoint.py \\
        --dir /tmp/ckpt

Builds the bench_train.py model with DistributedFusedAdam, takes one step (so the state is
populated), then times ``shardopt.checkpoint.save`` and ``load`` (with the model), reporting per
rank: seconds, GB written/read and GB/s, peak host RSS and peak device memory during each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import import_shardopt  # noqa: E402
from bench_train_model import GPT, ModelConfig  # noqa: E402


def rss_gib() -> float:
    """Peak resident set size of this process so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/shardopt-ckpt-bench"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    shardopt = import_shardopt()
    from shardopt import checkpoint

    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    cfg = ModelConfig(
        layers=args.layers,
        d_model=args.d_model,
        heads=max(1, args.d_model // 128),
        vocab=args.vocab,
        seq=args.seq,
    )
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab, (1, cfg.seq), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        model(idx, idx).backward()
    opt.step()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        return seconds, peak

    base_dev = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
    save_s, save_peak = timed(lambda: checkpoint.save(args.dir, opt, model))
    save_rss = rss_gib()
    total = dir_bytes(args.dir)
    mine = (args.dir / f"rank{rank:05d}-of-{world:05d}.pt").stat().st_size
    load_s, load_peak = timed(lambda: checkpoint.load(args.dir, opt, model))
    load_rss = rss_gib()
    row = {
        "rank": rank,
        "world": world,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_gb": total / 1e9,
        "rank_file_gb": mine / 1e9,
        "save_s": save_s,
        "save_gbs": total / 1e9 / save_s,
        "load_s": load_s,
        "load_gbs": total / 1e9 / load_s,
        "device_gib_before": base_dev,
        "save_peak_device_gib": save_peak,
        "load_peak_device_gib": load_peak,
        "peak_rss_gib_after_save": save_rss,
        "peak_rss_gib_after_load": load_rss,
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            print(
                " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                )
            )
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
