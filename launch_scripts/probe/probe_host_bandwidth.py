"""The host's memory bandwidth against the offloaded update's: is the CPU Adam of the offload
path at the host's DRAM limit, and how much does the pipeline's DMA beside it take?

    python3 launch_scripts/probe/probe_host_bandwidth.py            # one GPU; ~23 GB host memory
    python3 launch_scripts/probe/probe_host_bandwidth.py --buckets 4 --numel 4194304   # CPU, small

Every line is the median of ``--rounds`` timed rounds after one, on ``--threads`` threads (default
every core), of one of:

- ``copy``: ``dst.copy_(src)`` of the update's size in fp32 (read + write, 8 B an element);
- ``read``: ``src.sum()`` (4 B an element);
- ``in place``: ``src.mul_(1.0)`` (read and write back, 8 B an element: the update's access to
  its state; a copy's stores also read each line they write first, so its DRAM traffic is 12 B);
- ``adam one call``: shardopt's CPU Adam over every bucket in one call: fp32 masters and
  moments, bf16 grads in, bf16 params out (28 B/param), as ``cpu_update`` of bench_offload.py;
- ``adam per bucket``: the same, one call per bucket (as the offload worker runs it);
- ``adam per bucket, thread``: the same on one long-lived thread (as the offload worker's);
- ``dma alone`` (GPU): each bucket's bf16 grads copied down into a page-locked slot and its bf16
  params up from another, on two copy streams, back to back (the pipeline's 4 B/param of DMA);
- ``adam per bucket + dma``: both at once, the copies of bucket i+1 in flight during bucket
  i's update (the pipeline's traffic without its GPU work and bookkeeping), on the main thread
  and (``, thread``) on the long-lived thread.

GB/s counts the bytes each must move (copy 8, read 4, in place 8, adam 28, dma 4 B/element). If
``adam one call`` is near ``in place``, the update alone is at the host's DRAM limit;
``adam per bucket + dma`` against ``adam per bucket`` is what the DMA costs the update.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

# the benchmarks' shared pieces, from their folder (see docs/design.md, Note: launch_scripts)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_common import import_shardopt  # noqa: E402


def timed(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Worker:
    """One long-lived thread that runs the functions it is handed, on ``threads`` intra-op
    threads, as the offload worker runs its jobs (its own OpenMP team, made once); called with
    a function it runs it there and returns when it is done; called with None it stops."""

    def __init__(self, threads: int) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(threads,), daemon=True)
        self.thread.start()

    def _serve(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while (job := self.jobs.get()) is not None:
            fn, done = job
            try:
                fn()
            finally:
                done.set()

    def __call__(self, fn) -> None:
        if fn is None:
            self.jobs.put(None)
            self.thread.join()
            return
        done = threading.Event()
        self.jobs.put((fn, done))
        done.wait()


def plain(total: int, rounds: int, row, host_memory) -> None:
    """The copy, read and in-place rows (fp32 tensors of ``total`` elements)."""
    src = host_memory.empty(total, torch.float32, False).uniform_(-1, 1)
    dst = host_memory.empty(total, torch.float32, False).zero_()
    row("copy", timed(lambda: dst.copy_(src), rounds), 8 * total)
    row("read", timed(lambda: src.sum(), rounds), 4 * total)
    row("in place", timed(lambda: src.mul_(1.0), rounds), 8 * total)


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    """Prints and returns the rows: (name, ms, GB/s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buckets", type=int, default=51)
    ap.add_argument("--numel", type=int, default=26 * 1024 * 1024, help="params per bucket")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    import_shardopt()
    from shardopt import kernels as K
    from shardopt.zero.offload import host_memory

    torch.set_num_threads(args.threads)
    nb, n = args.buckets, args.numel
    total = nb * n
    cuda = torch.cuda.is_available()
    rows: list[tuple[str, float, float]] = []

    def row(name: str, seconds: float, nbytes: float) -> None:
        rows.append((name, seconds * 1e3, nbytes / seconds / 1e9))
        print(f"{name:28s} {seconds * 1e3:9.1f} ms {nbytes / seconds / 1e9:8.1f} GB/s", flush=True)

    plain(total, args.rounds, row, host_memory)

    def host(dtype: torch.dtype) -> list[torch.Tensor]:
        return [host_memory.empty(n, dtype, False).zero_() for _ in range(nb)]

    grads, masters = host(torch.bfloat16), host(torch.float32)
    exp_avg, exp_avg_sq, outs = host(torch.float32), host(torch.float32), host(torch.bfloat16)
    for g, p in zip(grads, masters):
        g.uniform_(-1e-3, 1e-3)
        p.uniform_(-0.05, 0.05)
    step = [0]

    def adam(lists: list[list[torch.Tensor]]) -> None:
        step[0] += 1
        K.adam(lists, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=step[0],
               adam_w_mode=True, bias_correction=True, weight_decay=0.1)  # fmt: skip

    def one_call() -> None:
        adam([grads, masters, exp_avg, exp_avg_sq, outs])

    def per_bucket() -> None:
        for i in range(nb):
            adam([[grads[i]], [masters[i]], [exp_avg[i]], [exp_avg_sq[i]], [outs[i]]])

    worker = Worker(args.threads)
    row("adam one call", timed(one_call, args.rounds), 28 * total)
    row("adam per bucket", timed(per_bucket, args.rounds), 28 * total)
    row("adam per bucket, thread", timed(lambda: worker(per_bucket), args.rounds), 28 * total)
    if cuda:
        dev = torch.device("cuda", 0)
        down_src = torch.empty(n, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
        up_dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
        down = [torch.empty(n, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
        up = [torch.empty(n, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
        d2h, h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

        def copies(i: int) -> list[torch.cuda.Event]:
            events = []
            for stream, d, s in ((d2h, down[i % 2], down_src), (h2d, up_dst, up[i % 2])):
                with torch.cuda.stream(stream):
                    d.copy_(s, non_blocking=True)
                    e = torch.cuda.Event()
                    e.record(stream)
                    events.append(e)
            return events

        def dma_alone() -> None:
            last = []
            for i in range(nb):
                for e in last:
                    e.synchronize()
                last = copies(i)
            torch.cuda.synchronize(dev)

        def per_bucket_dma() -> None:
            pending = copies(0)
            for i in range(nb):
                nxt = copies(i + 1) if i + 1 < nb else []
                for e in pending:
                    e.synchronize()
                adam([[grads[i]], [masters[i]], [exp_avg[i]], [exp_avg_sq[i]], [outs[i]]])
                pending = nxt
            torch.cuda.synchronize(dev)

        row("dma alone", timed(dma_alone, args.rounds), 4 * total)
        row("adam per bucket + dma", timed(per_bucket_dma, args.rounds), 28 * total)
        row("adam per bucket + dma, thread", timed(lambda: worker(per_bucket_dma), args.rounds),
            28 * total)  # fmt: skip
    worker(None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "buckets": nb, "numel": n, "threads": args.threads,
                    "rows": [{"name": a, "ms": b, "gbs": c} for a, b, c in rows],
                },
                f, indent=1,
            )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
