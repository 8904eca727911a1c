"""CPU Adam kernels side by side: shardopt's against DeepSpeedCPUAdam and torch's fused AdamW.

    python launch_scripts/bench/bench_cpu_adam.py --threads 16 --out bench_cpu_adam.json
    python launch_scripts/bench/bench_cpu_adam.py --tensors 4 --numel 4096 --threads 2  # quick

AdamW (lr 1e-3, weight decay 0.01) over ``--tensors`` x ``--numel`` params (default 64 x 4M =
268M) on the CPU, ``--threads`` torch and OpenMP threads; each kernel runs ``--warmup`` steps,
then the median (and min) of ``--steps`` timed steps (``time.perf_counter``). Kernels:

  shardopt_fp32              shardopt.FusedAdam on fp32 params and grads
  shardopt_fp32_bf16_out     shardopt's Adam kernel with fp32 grads, fp32 masters and moments,
                             writing the bf16 param in the same pass (the fused cast-out)
  shardopt_bf16_grads_bf16_out  the same with bf16 grads in: what the offload path runs on a
                             grad shard that came over PCIe in its own dtype
  deepspeed_cpu_adam         deepspeed.ops.adam.DeepSpeedCPUAdam on fp32 (its op JIT-built on
                             first use; skipped when deepspeed does not import or build)
  deepspeed_cpu_adam_copy_out  the same, then the separate fp32 -> bf16 copy into a second
                             buffer, as DeepSpeed's ZeRO-2 offload does after its CPU step
  torch_fused                torch.optim.AdamW(fused=True)
  torch_foreach              torch.optim.AdamW(foreach=True)

Bytes per param are counted from what each kernel must read and write (fp32 Adam: 28 B;
bf16 grads in and bf16 out: 28 B; fp32 grads and bf16 out: 30 B; DeepSpeed with copy-out: 34 B),
so the GB/s column compares them against the host's DRAM bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import environment, import_shardopt, write_json  # noqa: E402
from bench_offload_report import markdown  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = {
    "shardopt_fp32": 28,
    "shardopt_fp32_bf16_out": 30,
    "shardopt_bf16_grads_bf16_out": 28,
    "deepspeed_cpu_adam": 28,
    "deepspeed_cpu_adam_copy_out": 34,
    "torch_fused": 28,
    "torch_foreach": 28,
}
KERNELS = list(BYTES_PER_PARAM)


class Skipped(Exception):
    """The kernel cannot run here; the message says why."""


def make_params(args: argparse.Namespace) -> list[torch.Tensor]:
    """fp32 params with fp32 ``.grad`` (first touched here, by the threads that will use them)."""
    params = []
    for _ in range(args.tensors):
        p = torch.empty(args.numel).uniform_(-0.05, 0.05)
        p.grad = torch.empty(args.numel).uniform_(-1e-3, 1e-3)
        params.append(p)
    return params


def shardopt_kernel(args: argparse.Namespace, grad_dtype: torch.dtype) -> Callable[[], None]:
    """One call of shardopt's multi-tensor Adam over fp32 masters and moments writing bf16."""
    from shardopt import kernels as _ops

    params = make_params(args)
    grads = [p.grad.to(grad_dtype) for p in params]  # (a copy for bf16: the fp32 grad goes)
    for p in params:
        p.grad = None
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    step = [0]

    def run() -> None:
        step[0] += 1
        _ops.adam(
            [grads, params, exp_avg, exp_avg_sq, outs],
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            step=step[0],
            adam_w_mode=True,
            bias_correction=True,
            weight_decay=WEIGHT_DECAY,
        )

    return run


def deepspeed_adam(args: argparse.Namespace, copy_out: bool) -> Callable[[], None]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        raise Skipped(f"deepspeed does not import: {e}") from e
    params = make_params(args)
    try:
        opt = DeepSpeedCPUAdam(
            params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True
        )
    except Exception as e:  # its op failed to build or load here
        raise Skipped(f"DeepSpeedCPUAdam: {type(e).__name__}: {e}") from e
    if not copy_out:
        return opt.step
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]

    def run() -> None:
        opt.step()
        for out, p in zip(outs, params, strict=True):
            out.copy_(p)

    return run


def build(name: str, args: argparse.Namespace) -> Callable[[], None]:
    """The step function of kernel ``name`` over freshly made params and grads."""
    if name == "shardopt_fp32":
        shardopt = import_shardopt()
        opt = shardopt.FusedAdam(
            make_params(args),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            adam_w_mode=True,
        )
        return opt.step
    if name == "shardopt_fp32_bf16_out":
        return shardopt_kernel(args, torch.float32)
    if name == "shardopt_bf16_grads_bf16_out":
        return shardopt_kernel(args, torch.bfloat16)
    if name in ("deepspeed_cpu_adam", "deepspeed_cpu_adam_copy_out"):
        return deepspeed_adam(args, copy_out=name.endswith("copy_out"))
    if name in ("torch_fused", "torch_foreach"):
        flag = {"fused": True} if name == "torch_fused" else {"foreach": True}
        opt = torch.optim.AdamW(
            make_params(args),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            **flag,
        )
        return opt.step
    raise ValueError(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        step = build(name, args)
    except Skipped as e:
        return {"skipped": str(e)}
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    del step
    gc.collect()  # this kernel's tensors go before the next one's are made
    ms = statistics.median(times)
    n = args.tensors * args.numel
    return {
        "median_ms": ms,
        "min_ms": min(times),
        "times_ms": times,
        "bytes_per_param": BYTES_PER_PARAM[name],
        "gbs": n * BYTES_PER_PARAM[name] / (ms / 1e3) / 1e9,
    }


def summary(results: dict[str, dict[str, Any]]) -> list[str]:
    """The targets: ours >= 1.05x DeepSpeedCPUAdam and torch fused; the cast-out path within 5%
    of the fp32-only kernel."""

    def ms(name: str) -> float | None:
        return results.get(name, {}).get("median_ms")

    lines = []
    ours = ms("shardopt_fp32")
    for peer in ("deepspeed_cpu_adam", "torch_fused", "torch_foreach"):
        if ours and ms(peer):
            lines.append(f"{peer} / shardopt_fp32: {ms(peer) / ours:.2f}x (target >= 1.05x)")
    for name in ("shardopt_bf16_grads_bf16_out", "shardopt_fp32_bf16_out"):
        if ours and ms(name):
            lines.append(f"{name} / shardopt_fp32: {ms(name) / ours:.3f} (target <= 1.05)")
    if ms("deepspeed_cpu_adam_copy_out") and ms("shardopt_bf16_grads_bf16_out"):
        ratio = ms("deepspeed_cpu_adam_copy_out") / ms("shardopt_bf16_grads_bf16_out")
        lines.append(f"deepspeed_cpu_adam_copy_out / shardopt_bf16_grads_bf16_out: {ratio:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--numel", type=int, default=4 * 2**20, help="elements per tensor")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"from {','.join(KERNELS)}")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    bad = [k for k in kernels if k not in KERNELS]
    if bad:
        p.error(f"--kernels: unknown {bad}; choose from {', '.join(KERNELS)}")
    # DeepSpeed's op reads OpenMP's thread count; torch's kernels read torch's
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    n = args.tensors * args.numel
    print(
        f"{env['date']}  {env['device_name']}  torch {env['torch']}  commit {env['commit']}  "
        f"{env['cpu_count']} CPUs, {args.threads} threads; AdamW over {args.tensors} x "
        f"{args.numel:,} = {n:,} params, median of {args.steps} steps after {args.warmup}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    report = {"environment": env, "args": vars(args), "params": n, "kernels": results}
    for name in kernels:
        results[name] = measure(name, args)
        r = results[name]
        if "median_ms" in r:
            print(f"{name}: {r['median_ms']:.1f} ms ({r['gbs']:.1f} GB/s)", flush=True)
        else:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED {r['error']}"
            print(f"{name}: {why}", flush=True)
        write_json(args.out, report)
    base = results.get("shardopt_fp32", {}).get("median_ms")
    rows = [
        [
            name,
            r["median_ms"],
            r["min_ms"],
            r["bytes_per_param"],
            r["gbs"],
            r["median_ms"] / base if base else None,
        ]  # fmt: skip
        for name, r in results.items()
        if "median_ms" in r
    ]
    headers = ["kernel", "median ms", "min ms", "B/param", "GB/s", "vs shardopt_fp32"]
    print(markdown(headers, rows))
    report["summary"] = summary(results)
    for line in report["summary"]:
        print(line)
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
