"""The CPU Adam kernel (fp32 masters and moments, bf16 grads in, bf16 params out) over 64M
params on 2 threads, median of 10 steps after 2; run it beside a busy process to see a thread
whose core is shared (Note: items taken one by one, csrc/multi_tensor/cpu_apply.h):

    python launch_scripts/probe/probe_cpu_sharing.py idle
    python -c "while True: pass" & python launch_scripts/probe/probe_cpu_sharing.py busy; kill %1
"""

import statistics
import sys
import time

import torch

from shardopt import kernels as K


def main() -> None:
    torch.set_num_threads(2)
    n, chunk = 64 * 2**20, 4 * 2**20
    sizes = [chunk] * (n // chunk)
    g = [torch.empty(s, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3) for s in sizes]
    p = [torch.empty(s).uniform_(-0.05, 0.05) for s in sizes]
    m = [torch.zeros(s) for s in sizes]
    v = [torch.zeros(s) for s in sizes]
    o = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    times = []
    for it in range(12):
        start = time.perf_counter()
        K.adam([g, p, m, v, o], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, step=it + 1,
               adam_w_mode=True, bias_correction=True, weight_decay=0.1)  # fmt: skip
        if it >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    print(f"{label} median {statistics.median(times):.1f} ms  min {min(times):.1f} ms")


if __name__ == "__main__":
    main()
