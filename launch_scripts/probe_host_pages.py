"""Host pages and the CPU update of offload: the offload kernel (fp32 masters and moments, bf16
grads in, bf16 params out, shardopt.kernels.adam) over state allocated three ways, in alternating
rounds: ``4k`` torch's allocator (4 KiB pages unless the OS backs them otherwise); ``huge_aligned``
shardopt's huge-page mappings with every tensor 2 MiB-aligned; ``huge_staggered`` the same with
the starts of host_memory.OFFSETS (CPUOffload(huge_pages=True)). Prints each round's median step
and the transparent huge pages the process held.

    python3 launch_scripts/probe_host_pages.py --params 536870912 --chunk 26214400 --rounds 2
"""

import argparse
import os
import statistics
import time

import torch

from shardopt import kernels as K
from shardopt.zero import host_memory

LAYOUTS = {
    "4k": dict(huge_pages=False),
    "huge_aligned": dict(huge_pages=True, offset=0),
    "huge_staggered": dict(huge_pages=True),
}


def huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages")), 0)


def measure(args, layout: dict) -> tuple[float, int]:
    sizes = [min(args.chunk, args.params - i) for i in range(0, args.params, args.chunk)]

    def host(n, dtype=torch.float32):
        return host_memory.empty(n, dtype, **layout)

    grads = [host(n, torch.bfloat16).uniform_(-1e-3, 1e-3) for n in sizes]
    masters = [host(n).uniform_(-0.05, 0.05) for n in sizes]
    exp_avg = [host(n).zero_() for n in sizes]
    exp_avg_sq = [host(n).zero_() for n in sizes]
    outs = [host(n, torch.bfloat16).zero_() for n in sizes]
    held = huge_kib()
    times = []
    for it in range(args.warmup + args.steps):
        start = time.perf_counter()
        K.adam([grads, masters, exp_avg, exp_avg_sq, outs], lr=1e-4, beta1=0.9, beta2=0.999,
               eps=1e-8, step=it + 1, adam_w_mode=True, bias_correction=True,
               weight_decay=0.1)  # fmt: skip
        if it >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), held


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, default=512 * 2**20)
    p.add_argument("--chunk", type=int, default=25 * 2**20, help="elements per tensor (a bucket)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    print(f"{args.params} params in tensors of {args.chunk}, {args.threads} threads, THP: {thp}")
    print("| round | layout | median ms | GB/s (28 B/param) | AnonHugePages GiB |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        for name, layout in LAYOUTS.items():
            ms, held = measure(args, layout)
            gbs = 28 * args.params / ms / 1e6
            print(f"| {r} | {name} | {ms:.1f} | {gbs:.1f} | {held / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
