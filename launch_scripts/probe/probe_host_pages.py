"""Host pages and the CPU update of offload: the offload kernel (fp32 masters and moments, bf16
grads in, bf16 params out, shardopt.kernels.adam) over state allocated several ways, in
alternating rounds. A case is ``pages-touch-shape``:

- pages: ``4k`` torch's allocator (4 KiB pages unless the OS backs them otherwise);
  ``aligned`` shardopt's huge-page mappings with every tensor 2 MiB-aligned; ``huge`` the same
  with the starts of host_memory.OFFSETS (CPUOffload(huge_pages=True));
- touch: who touches the pages first: ``par`` a fill on every thread (as the offload path's
  host state), ``ser`` a fill on one thread (as the bench's ``cpu_update``, whose ``uniform_`` is
  serial);
- shape: ``chunks`` tensors of ``--chunk`` elements, one call over all (the bench's
  ``cpu_update``); ``flat`` one tensor each of masters and moments with a ring of four grad and
  four out slots of ``--chunk``, one call per bucket (the pipeline's host state and slots).

Prints each round's median step and the transparent huge pages the process held.

    python3 launch_scripts/probe/probe_host_pages.py --params 536870912 --chunk 26214400 --rounds 2
    python3 launch_scripts/probe/probe_host_pages.py --cases 4k-par-flat,4k-ser-flat,4k-ser-chunks
"""

import argparse
import os
import statistics
import time

import torch

from shardopt import kernels as K
from shardopt.zero.offload import host_memory

PAGES = {
    "4k": dict(huge_pages=False),
    "aligned": dict(huge_pages=True, offset=0),
    "huge": dict(huge_pages=True),
}
DEFAULT_CASES = "4k-par-chunks,4k-ser-chunks,4k-par-flat,4k-ser-flat,huge-par-flat,huge-ser-flat"


def huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages")), 0)


def adam(lists: list[list[torch.Tensor]], step: int) -> None:
    K.adam(lists, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, step=step, adam_w_mode=True,
           bias_correction=True, weight_decay=0.1)  # fmt: skip


def build(args, case: str):
    """The function that runs one step over the state of ``case``, and that state's masters (in
    element order)."""
    pages, touch, shape = case.split("-")

    def host(n: int, dtype: torch.dtype = torch.float32, value: float = 0.0) -> torch.Tensor:
        t = host_memory.empty(n, dtype, **PAGES[pages])
        torch.set_num_threads(1 if touch == "ser" else args.threads)
        t.zero_()  # the first touch
        torch.set_num_threads(args.threads)
        return t.fill_(value)

    sizes = [min(args.chunk, args.params - i) for i in range(0, args.params, args.chunk)]
    if shape == "chunks":
        g = [host(n, torch.bfloat16, 1e-3) for n in sizes]
        p = [host(n, value=0.01) for n in sizes]
        m, v = ([host(n) for n in sizes] for _ in range(2))
        o = [host(n, torch.bfloat16) for n in sizes]
        return (lambda step: adam([g, p, m, v, o], step)), p
    if shape != "flat":
        raise ValueError(f"unknown shape {shape!r} in case {case!r}")
    big = max(sizes)
    p, m, v = host(args.params, value=0.01), host(args.params), host(args.params)
    g = [host(big, torch.bfloat16, 1e-3) for _ in range(4)]
    o = [host(big, torch.bfloat16) for _ in range(4)]

    def per_bucket(step: int) -> None:
        for k, n in enumerate(sizes):
            i = k * args.chunk
            views = [g[k % 4][:n]], [p[i : i + n]], [m[i : i + n]], [v[i : i + n]], [o[k % 4][:n]]
            adam(list(views), step)

    return per_bucket, [p]


def measure(args, case: str) -> tuple[float, float, int]:
    start = time.perf_counter()
    step, _ = build(args, case)
    built = time.perf_counter() - start
    held = huge_kib()
    times = []
    for it in range(args.warmup + args.steps):
        start = time.perf_counter()
        step(it + 1)
        if it >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), built, held


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, default=512 * 2**20)
    p.add_argument("--chunk", type=int, default=25 * 2**20, help="elements per tensor (a bucket)")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated pages-touch-shape")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    print(f"{args.params} params in tensors of {args.chunk}, {args.threads} threads, THP: {thp}")
    print("| round | case | median ms | GB/s (28 B/param) | build s | AnonHugePages GiB |")
    print("|---|---|---|---|---|---|")
    cases = args.cases.split(",")
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            ms, built, held = measure(args, case)
            gbs = 28 * args.params / ms / 1e6
            print(f"| {r} | {case} | {ms:.1f} | {gbs:.1f} | {built:.1f} | {held / 2**20:.1f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
