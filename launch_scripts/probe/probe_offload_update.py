"""What slows the CPU Adam of the offload path down per bucket: thread count, per-bucket calls,
the grad/param copies beside it, a GPU busy with launches from another thread.

    python3 launch_scripts/probe/probe_offload_update.py  # one GPU; ~22 GB host memory per layout

51 buckets of 26M params (1.39B; the 1.4B GPT's bucket shape): fp32 masters and moments, bf16
grads in and bf16 params out (pinned exact-size slots). Each line: the median of 3 timed steps
(after one) of the whole update, ms: one kernel call over every bucket; per bucket on a worker
thread (as offload_worker.py runs it); with a synchronous 52 MB device-to-host copy before each
bucket and a host-to-device copy after it; and with the main thread running bf16 matmuls and gelus
meanwhile. ``flat``: the state in one allocation per tensor kind (as the optimizer's flat shards)
or one tensor per bucket.
"""

import statistics
import threading
import time

import torch

from shardopt import kernels as K

NB, N = 51, 26 * 1024 * 1024
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)


def alloc(flat: bool):
    if flat:
        tot = NB * N
        P, M, V = torch.zeros(tot), torch.zeros(tot), torch.zeros(tot)
        return [
            (P[i * N : (i + 1) * N], M[i * N : (i + 1) * N], V[i * N : (i + 1) * N])
            for i in range(NB)
        ]
    return [
        (torch.empty(N).uniform_(-0.05, 0.05), torch.zeros(N), torch.zeros(N)) for _ in range(NB)
    ]


def slots(pin):
    s = [torch.empty(N, dtype=torch.bfloat16) for _ in range(4)]
    o = [torch.empty(N, dtype=torch.bfloat16) for _ in range(4)]
    if pin:
        cr = torch.cuda.cudart()
        for b in s + o:
            cr.cudaHostRegister(b.data_ptr(), b.numel() * 2, 0)
    for b in s:
        b.uniform_(-1e-3, 1e-3)
    return s, o


def adam(lists, step):
    K.adam(
        lists,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        step=step,
        adam_w_mode=True,
        bias_correction=True,
        weight_decay=0.01,
    )


def one_call(state, s, o, threads):
    torch.set_num_threads(threads)
    g = [s[i % 4] for i in range(NB)]
    outs = [o[i % 4] for i in range(NB)]
    ts = []
    for step in range(1, 5):
        t = time.perf_counter()
        adam([g, [x[0] for x in state], [x[1] for x in state], [x[2] for x in state], outs], step)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts[1:])


def per_bucket(state, s, o, threads, copies=False, gpu=None):
    res = {}
    dgrad = torch.empty(N, dtype=torch.bfloat16, device=dev)
    dparam = torch.empty(N, dtype=torch.bfloat16, device=dev)
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()

    def work():
        torch.cuda.set_device(dev)
        torch.set_num_threads(threads)
        ts = []
        for step in range(1, 5):
            t = time.perf_counter()
            for i, (p, m, v) in enumerate(state):
                if copies:
                    with torch.cuda.stream(d2h):
                        s[i % 4].copy_(dgrad, non_blocking=True)
                        e = torch.cuda.Event()
                        e.record(d2h)
                    e.synchronize()
                adam([[s[i % 4]], [p], [m], [v], [o[i % 4]]], step)
                if copies:
                    with torch.cuda.stream(h2d):
                        dparam.copy_(o[i % 4], non_blocking=True)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        res["ms"] = statistics.median(ts[1:])

    stop = [False]

    def gpu_load():  # the main thread launching many small kernels, as a forward does
        a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
        while not stop[0]:
            for _ in range(50):
                a = torch.nn.functional.gelu(a @ a * 1e-3)
            torch.cuda.synchronize()

    th = threading.Thread(target=work)
    if gpu:
        g = threading.Thread(target=gpu_load)
        g.start()
    th.start()
    th.join()
    stop[0] = True
    if gpu:
        g.join()
    return res["ms"]


if __name__ == "__main__":
    for flat in (False, True):
        state = alloc(flat)
        s, o = slots(pin=True)
        one = {thr: one_call(state, s, o, thr) for thr in (16, 15)}
        print(f"flat={flat}: one call 16 thr {one[16]:.1f} ms | 15 thr {one[15]:.1f}")
        for thr in (16, 15, 12):
            print(
                f"  per bucket on a thread, {thr} thr: {per_bucket(state, s, o, thr):.1f} ms"
                f" | + copies {per_bucket(state, s, o, thr, copies=True):.1f}"
                f" | + copies + GPU {per_bucket(state, s, o, thr, copies=True, gpu=True):.1f}"
            )
        del state, s, o
