"""A small harness for distributed tests: real processes on gloo.

``run_cases(cases, world_size)`` spawns ``world_size`` processes ONCE, each joins a gloo group
through a FileStore in a TemporaryDirectory with one intra-op thread, runs every case function
``case(rank, world_size)`` in order (a barrier between cases) and reports per case either None
or the first rank's traceback. A timeout turns a hang into a failure instead of blocking CI.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Case = Callable[[int, int], None]


def _worker(rank: int, world: int, store_path: str, cases: list[Case], queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for case in cases:
        try:
            case(rank, world)
            results[case.__name__] = None
        except Exception:  # reported to the parent, which fails the test
            results[case.__name__] = traceback.format_exc()
        dist.barrier()
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def run_cases(cases: list[Case], world_size: int, timeout: float = 300.0) -> dict[str, str | None]:
    """Runs ``cases`` on ``world_size`` gloo ranks; returns {case name: None or a traceback}."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, cases, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        if hung:
            raise TimeoutError(f"distributed cases hung for {timeout}s on {world_size} ranks")
        results: dict[str, str | None] = {c.__name__: None for c in cases}
        got = 0
        while not queue.empty():
            rank, per_rank = queue.get()
            got += 1
            for name, err in per_rank.items():
                if err is not None and results[name] is None:
                    results[name] = f"rank {rank}:\n{err}"
        if got != world_size:
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"only {got} of {world_size} ranks reported (exit codes {codes})")
        return results
