"""A small harness for distributed tests: real processes on gloo.

``run_cases(cases, world_size)`` spawns ``world_size`` processes ONCE, each joins a gloo group
through a FileStore in a TemporaryDirectory with one intra-op thread, runs every case function
``case(rank, world_size)`` in order (a barrier between cases) and reports per case either None
or the first rank's traceback. A timeout turns a hang into a failure instead of blocking CI.

Each rank reports every case as soon as it ends and the parent reads the reports while it waits
(a report is never stuck in a full pipe), so a hang names the case the ranks were in.
``pg_timeout`` sets the process group's timeout: a collective that a crashed or diverged rank
never joins then fails after that many seconds instead of gloo's 30 minutes.
``report_hangs=True`` fails the case that hung or broke the process group instead of raising,
and runs the cases after it in a fresh launch, so every other case still reports.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Case = Callable[[int, int], None]


def _worker(
    rank: int,
    world: int,
    store_path: str,
    cases: list[Case],
    queue,
    pg_timeout: float | None,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    kw = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, **kw)
    for case in cases:
        queue.put(("start", rank, case.__name__, None))
        try:
            case(rank, world)
            err = None
        except KeyboardInterrupt:
            raise
        except BaseException:  # reported to the parent, which fails the test (pytest's
            err = traceback.format_exc()  # failures from pytest.raises/fail are BaseExceptions)
        queue.put(("done", rank, case.__name__, err))
        dist.barrier()
    queue.put(("finished", rank, None, None))
    dist.barrier()
    dist.destroy_process_group()


def _launch(cases: list[Case], world_size: int, timeout: float, pg_timeout: float | None):
    """One spawn of ``world_size`` ranks running ``cases``. Returns (results, started, done,
    None) when every rank finished, else (..., message) describing the hang or death."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    names = [c.__name__ for c in cases]
    results: dict[str, str | None] = dict.fromkeys(names)
    current: dict[int, str | None] = dict.fromkeys(range(world_size))
    finished: set[int] = set()
    started = dict.fromkeys(names, 0)  # ranks that started each case
    done = dict.fromkeys(names, 0)  # ranks that finished each case
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store, cases, queue, pg_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(finished) < world_size and time.monotonic() < deadline:
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(0.5)  # let the other ranks' last reports arrive
                    if queue.empty():
                        break
                time.sleep(0.02)
                continue
            what, rank, name, err = queue.get()
            if what == "start":
                current[rank] = name
                started[name] += 1
            elif what == "done":
                current[rank] = None
                done[name] += 1
                if err is not None and results[name] is None:
                    results[name] = f"rank {rank}:\n{err}"
            else:
                finished.add(rank)
        for p in procs:
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if len(finished) == world_size:
            return results, started, done, None
        codes = [p.exitcode for p in procs]
        stuck = {r: n for r, n in current.items() if n is not None and r not in finished}
        where = ", ".join(f"rank {r} in {n}" for r, n in sorted(stuck.items())) or "between cases"
        what = f"hung for {timeout:.0f}s" if hung else f"died (exit codes {codes})"
        message = f"distributed cases {what} on {world_size} ranks: {where}"
        return results, started, done, (TimeoutError if hung else RuntimeError)(message)


def run_cases(
    cases: list[Case],
    world_size: int,
    timeout: float = 300.0,
    *,
    pg_timeout: float | None = None,
    report_hangs: bool = False,
) -> dict[str, str | None]:
    """Runs ``cases`` on ``world_size`` gloo ranks; returns {case name: None or a traceback}.

    A hang or a dead rank raises (TimeoutError / RuntimeError naming the case the ranks were in),
    unless ``report_hangs``: then the case that hung or broke the process group (the one the
    ranks were in, else the last one they finished) fails with that message and the cases not
    yet started run in a fresh launch (``timeout`` bounds all launches together).
    """
    names = [c.__name__ for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    results: dict[str, str | None] = {}
    remaining = list(cases)
    deadline = time.monotonic() + timeout
    while remaining:
        got, started, done, failure = _launch(
            remaining, world_size, max(1.0, deadline - time.monotonic()), pg_timeout
        )
        results.update(got)
        if failure is None:
            break
        if not report_hangs:
            raise failure
        message = str(failure)
        culprits = [n for n in got if 0 < started[n] and done[n] < world_size]
        if not culprits:  # died between cases: blame the last case that ran
            ran = [n for n in got if started[n]]
            culprits = ran[-1:]
        for name in culprits:
            note = f"{message} (the process group broke in or after this case)"
            results[name] = note if results[name] is None else f"{results[name]}\n{note}"
        later = [c for c in remaining if started[c.__name__] == 0]
        if len(later) == len(remaining) or time.monotonic() >= deadline:
            for c in later:
                results[c.__name__] = f"not run: {message}"
            break
        remaining = later
    return {n: results[n] for n in names}
