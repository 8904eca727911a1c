"""Timeline of one offloaded training iteration of the bench's GPT (one GPU, NCCL world 1).

    PYTHONPATH=. python3 launch_scripts/probe/trace_offload.py --clip off|on

Wraps the offload pipeline's methods (staging, each bucket's update, the worker's CUDA event waits,
the main thread's waits for buckets) with host timestamps and prints, for one iteration after
warm-up and for the next forward, each one's count, total time and first start / last end in ms from
the iteration's start (threads: ``MainThread`` the training loop, ``shardopt-offload`` the offload
worker, ``shardopt-update`` its update thread).
``kernel``: the Adam kernel calls as Python sees them (the C++ time plus the wait for the GIL when
the call returns), on the update thread with ``update``, ``restart``, ``release``; ``stage``,
``hand``, ``finish``, ``slot_take``, ``copy_issue``, ``rs_wait``: the worker's bookkeeping per
bucket, part by part (nested: ``stage`` holds the bucket's reduce-scatter wait ``rs_wait``, a
``slot_take`` and a ``copy_issue``; ``finish`` the wait for the bucket's update and its copies
up). Before the timeline, each thread's CPU time and run-queue wait (/proc schedstat) over the
last three iterations: the cores' oversubscription (an intra-op thread of the update waiting for a
CPU holds the bucket's kernel call up). The optimizer is the bench's (bench_offload_peers.py),
so its environment settings apply: e.g. BENCH_OFFLOAD_SWITCH_INTERVAL=none leaves Python's
switch interval at its default (CPUOffload(switch_interval=None)).
"""

import argparse
import collections
import os
import sys
import threading
import time
from pathlib import Path

import torch

# the offload bench's model and process group, from its folder (see docs/design.md,
# Note: launch_scripts)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_offload_peers import build, model_config  # noqa: E402
from bench_offload_worker import init_process_group  # noqa: E402

import shardopt.kernels as kernels  # noqa: E402
import shardopt.zero.engine as eng  # noqa: E402
import shardopt.zero.offload.pipeline as op  # noqa: E402
import shardopt.zero.offload.slots as slots  # noqa: E402
import shardopt.zero.offload.worker as ow  # noqa: E402
import shardopt.zero.optimizers as zo  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--clip", default="off")
p.add_argument("--width", type=int, default=2048)
p.add_argument("--depth", type=int, default=24)
p.add_argument("--steps", type=int, default=4)
args = p.parse_args()

T0 = [0.0]
EV = []  # (thread, name, start, end)
ON = [False]


def rec(name, start, end=None):
    if ON[0]:
        EV.append(
            (
                threading.current_thread().name[:16],
                name,
                (start - T0[0]) * 1e3,
                ((end if end is not None else start) - T0[0]) * 1e3,
            )
        )


def thread_times() -> dict[int, tuple[str, int, int]]:
    """Per thread of this process: (name, ns on a CPU, ns waiting for one on a run queue), from
    /proc's schedstat; Python threads by their Python name, the others (torch's intra-op threads,
    the CUDA and NCCL threads) by the kernel's."""
    names = {t.native_id: t.name[:16] for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        out[int(tid)] = (names.get(int(tid), comm), int(run), int(wait))
    return out


def report_threads(before, after, wall_ms: float) -> None:
    """CPU time and run-queue wait per thread over ``wall_ms`` (the cores' oversubscription:
    a thread waiting on a run queue had work and no CPU)."""
    rows = []
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        if run - run0 > 0 or wait - wait0 > 0:
            rows.append((name, tid, (run - run0) / 1e6, (wait - wait0) / 1e6))
    rows.sort(key=lambda r: -r[2])
    total_run = sum(r[2] for r in rows)
    total_wait = sum(r[3] for r in rows)
    cpus = len(os.sched_getaffinity(0))
    print(
        f"threads over {wall_ms:.1f} ms ({cpus} CPUs): on CPU {total_run:.1f} ms "
        f"({total_run / wall_ms:.2f} CPUs busy), run-queue wait {total_wait:.1f} ms"
    )
    for name, tid, run, wait in rows[:24]:
        print(f"  thread {name:16s} {tid:8d} run={run:8.1f} wait={wait:7.1f}")


def wrap(cls, attr, name):
    fn = getattr(cls, attr)

    def w(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            rec(name, s, time.perf_counter())

    setattr(cls, attr, w)


def timed_waits(fn):
    """``_stage`` with its reduce-scatter wait (an argument) stamped as ``rs_wait``."""

    def w(self, key, bucket, shards, wait=None, after=None):
        if wait is not None:
            inner = wait

            def wait():
                s = time.perf_counter()
                try:
                    inner()
                finally:
                    rec("rs_wait", s, time.perf_counter())

        return fn(self, key, bucket, shards, wait, after)

    return w


op.OffloadPipeline._stage = timed_waits(op.OffloadPipeline._stage)
wrap(op.OffloadPipeline, "_stage", "stage")
# the parts of a bucket's bookkeeping: the slot rings' reuse waits, each copy's issue (stream
# switch, copy, event), the view's per-bucket reset, the host views' release
wrap(slots.Slots, "take", "slot_take")
wrap(op.OffloadPipeline, "_copy", "copy_issue")
wrap(op, "restart", "restart")
wrap(op.host_state, "release", "release")
wrap(op.OffloadPipeline, "_run", "job")
wrap(op.OffloadPipeline, "_hand", "hand")
wrap(op.OffloadPipeline, "_finish", "finish")
wrap(op.OffloadPipeline, "submit_early", "submit_early")
wrap(zo.DistributedFusedAdam, "_update", "update")
wrap(ow.Progress, "wait_bucket", "wait_bucket")
wrap(ow.Progress, "wait_finished", "wait_finished")
wrap(ow.Progress, "publish", "publish")
wrap(torch.cuda.Event, "synchronize", "ev_sync")
wrap(eng.DistributedOptimizer, "step", "step()")
wrap(kernels, "adam", "kernel")

init_process_group("nccl")
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
cfg = model_config(args.width, args.depth, 50304, 2048)
clip = args.clip == "on"
tr = build("offload", cfg, dev, 4, False, (clip,))
opt = tr.optimizer
print("plan:", getattr(opt, "offload_plan", None))
print("buckets per key:", [len(k.layout.buckets) for k in opt.keys])
g = torch.Generator(device=dev).manual_seed(1)
idx, tgt = (torch.randint(50304, (4, 2048), device=dev, generator=g) for _ in range(2))
times = []
for it in range(args.steps + 2):
    torch.cuda.synchronize()
    ON[0] = it == args.steps + 1
    EV.clear() if ON[0] else None
    if it == args.steps - 1:  # the last three iterations' CPU use per thread
        sched_before, sched_t0 = thread_times(), time.perf_counter()
    T0[0] = time.perf_counter()
    s = time.perf_counter()
    loss = tr.forward(idx, tgt)
    rec("forward", s, time.perf_counter())
    s = time.perf_counter()
    tr.backward(loss)
    rec("backward(host)", s, time.perf_counter())
    if clip:
        s = time.perf_counter()
        tr.clip(1.0)
        rec("clip", s, time.perf_counter())
    s = time.perf_counter()
    tr.step()
    rec("step+zero_grad", s, time.perf_counter())
    # the next forward's start is where the iteration ends: time a forward-only module call
    s = time.perf_counter()
    torch.cuda.synchronize()
    rec("sync", s, time.perf_counter())
    times.append((time.perf_counter() - T0[0]) * 1e3)
sched_wall = (time.perf_counter() - sched_t0) * 1e3
report_threads(sched_before, thread_times(), sched_wall)
print("switch interval s (while the worker runs):", sys.getswitchinterval())
print("iteration ms (to sync after step):", [round(t, 1) for t in times])


def report(title):
    agg = collections.defaultdict(lambda: [0, 0.0, 1e9, -1e9])
    for th, n, a, b in EV:
        x = agg[(th, n)]
        x[0] += 1
        x[1] += b - a
        x[2] = min(x[2], a)
        x[3] = max(x[3], b)
    print(title)
    for (th, n), (c, tot, a, b) in sorted(agg.items(), key=lambda kv: kv[1][2]):
        print(f"  {th:16s} {n:16s} n={c:4d} total={tot:8.1f} first={a:8.1f} last_end={b:8.1f}")
    ups = [(a, b) for th, n, a, b in EV if n == "update"]
    print(
        "  updates (start, dur):",
        [(round(a), round(b - a, 1)) for a, b in ups[:4]],
        "...",
        [(round(a), round(b - a, 1)) for a, b in ups[-4:]],
    )
    syn = [(round(a), round(b - a, 1)) for th, n, a, b in EV if n == "ev_sync"]
    print("  ev_sync:", syn[:6], "...", syn[-4:])
    print("  ev_sync over 0.5 ms (start, dur):", [x for x in syn if x[1] > 0.5])
    early = [round(a, 1) for th, n, a, b in EV if n == "submit_early"]
    print("  submit_early starts:", early)
    first_early = min(early, default=float("inf"))
    print(
        "  updates from the first submit_early on (start, dur):",
        [(round(a), round(b - a, 1)) for a, b in ups if a > first_early - 1],
    )


report("traced iteration:")
# next iteration's forward waits for buckets: trace it too
ON[0] = True
T0[0] = time.perf_counter()
EV.clear()
s = time.perf_counter()
loss = tr.forward(idx, tgt)
rec("forward(next)", s, time.perf_counter())
torch.cuda.synchronize()
rec("sync", s, time.perf_counter())
report("next forward (waits for the updates):")
tr.close() if tr.close else None
