"""Step time of Adam over compact state (``kernels.adam_compact``) against ``kernels.adam``.

One flat shard of ``--numel`` elements (the distributed Adam's layout). For every master mode and
state format it prints the median step time, the bytes the step must move (grads, params,
remainders, both moments and their scales, each read and, except the grads, written), the GB/s
that makes, and the time of a torch copy of the same byte count as a percentage of the step's
(100% = the step runs at copy bandwidth)::

    python launch_scripts/bench/bench_state_formats.py                      # GPU: 256M elements
    python launch_scripts/bench/bench_state_formats.py --device cpu --numel 16777216 --threads 2

GPU times are CUDA events around each call after warm-up; CPU times perf_counter; medians.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import (
    environment,
    format_table,
    free_memory,
    import_shardopt,
    median,
    time_fn,
    write_json,
)

shardopt = import_shardopt()
from shardopt import kernels as _ops  # noqa: E402
from shardopt import state_codec as sc  # noqa: E402
from shardopt.kernels import compact as _compact_ops  # noqa: E402

HYPER = dict(
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    step=10,
    adam_w_mode=True,
    bias_correction=True,
    weight_decay=0.01,
)
MASTERS = ("fp32", "bf16+rem")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adam_case(numel, grad_dtype, out_dtype, device):
    """``_ops.adam`` with an fp32 master and fp32 moments (and an optional low-precision out)."""
    g = torch.randn(numel, device=device).to(grad_dtype)
    p = torch.randn(numel, device=device)
    m = torch.zeros(numel, device=device)
    v = torch.zeros(numel, device=device)
    lists = [[g], [p], [m], [v]]
    moved = _nbytes([g]) + 2 * _nbytes([p, m, v])
    if out_dtype is not None:
        out = torch.empty(numel, device=device, dtype=out_dtype)
        lists.append([out])
        moved += _nbytes([out])
    return (lambda: _ops.adam(lists, **HYPER)), moved


def compact_case(numel, grad_dtype, master, fmt, device):
    """``kernels.adam_compact`` on one flat shard; returns the step and the bytes it moves."""
    g = torch.randn(numel, device=device).to(grad_dtype)
    x = torch.randn(numel, device=device)
    params, rems = ([x], []) if master == "fp32" else ([t] for t in sc.split_master(x))
    dtype = sc.code_dtype(fmt)
    m = torch.zeros(numel, device=device, dtype=dtype)
    v = torch.zeros(numel, device=device, dtype=dtype)
    scales = []
    if sc.has_scales(fmt):
        scales = [[torch.zeros(sc.num_blocks(numel), device=device)] for _ in range(2)]
        if fmt == "int8":
            m.fill_(sc.zero_code(True))
    else:
        scales = [[], []]
    lists = [[g], params, rems, [m], [v], *scales]
    written = params + rems + [m, v] + [s for lst in scales for s in lst]
    moved = _nbytes([g]) + 2 * _nbytes(written)

    def step():
        _compact_ops.adam_compact(lists, state_format=fmt, **HYPER)

    return step, moved


def copy_ms(nbytes: int, device: torch.device) -> float:
    """Median time of a torch copy that reads and writes ``nbytes`` in total."""
    buffers = [torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()]
    buffers.append(torch.empty_like(buffers[0]))
    ms = median(
        time_fn(lambda: buffers[1].copy_(buffers[0]), device, warmup=3, min_iters=10, max_iters=100)
    )
    buffers.clear()
    free_memory(device)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=None, help="GPU 256M, CPU 16M by default")
    parser.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--formats", default=",".join(sc.FORMATS))
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = args.numel or (256 << 20 if device.type == "cuda" else 16 << 20)
    grad_dtype = torch.float32 if args.grad_dtype == "fp32" else torch.bfloat16
    bf16 = torch.bfloat16
    cases = [
        ("adam", "fp32", "fp32", lambda: adam_case(numel, grad_dtype, None, device)),
        ("adam +bf16 out", "fp32", "fp32", lambda: adam_case(numel, grad_dtype, bf16, device)),
    ]
    for master in MASTERS:
        for fmt in args.formats.split(","):

            def make(master=master, fmt=fmt):
                return compact_case(numel, grad_dtype, master, fmt, device)

            cases.append(("adam_compact", master, fmt, make))
    rows, results = [], []
    base_ms = None
    for kernel, master, fmt, make in cases:
        step, moved = make()
        ms = median(time_fn(step, device, warmup=5, min_iters=10, max_iters=100, target_s=2.0))
        del step
        free_memory(device)
        ref = copy_ms(moved, device)
        base_ms = base_ms or ms
        result = dict(
            kernel=kernel,
            master=master,
            state=fmt,
            ms=ms,
            bytes=moved,
            gbs=moved / ms / 1e6,
            copy_ms=ref,
            pct_copy=100 * ref / ms,
            vs_adam=ms / base_ms,
        )
        results.append(result)
        rows.append(
            [
                kernel,
                master,
                fmt,
                ms,
                moved / numel,
                result["gbs"],
                result["pct_copy"],
                result["vs_adam"],
            ]
        )
    print(f"{numel:,} elements, grads {args.grad_dtype}, {device}")
    headers = ["kernel", "master", "state", "ms", "B/elem", "GB/s", "% copy", "x adam"]
    print(format_table(headers, rows))
    env = environment(device)
    write_json(args.out, {"environment": env, "numel": numel, "results": results})


if __name__ == "__main__":
    main()
