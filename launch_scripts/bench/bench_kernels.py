"""Optimizer step time of shardopt's fused optimizers against torch.optim's fused and foreach ones.

One run measures the device copy bandwidth, then for each parameter set and dtype the median step
time of every optimizer on preallocated random grads, and prints ms, effective GB/s (the bytes the
update must move, see ``TRAFFIC``), torch / shardopt time ratios and the fraction of the copy
bandwidth reached::

    python launch_scripts/bench/bench_kernels.py --out bench_kernels.json            # GPU: all sets
    python launch_scripts/bench/bench_kernels.py --device cpu --threads 2            # CPU: 50M fp32

Each library keeps its default state dtype: shardopt keeps fp32 state for bf16 params, torch.optim
keeps state in the param dtype; the byte counts follow the dtypes actually allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from bench_common import (
    copy_bandwidth_gbs,
    environment,
    format_table,
    free_memory,
    import_shardopt,
    median,
    time_fn,
    write_json,
)

shardopt = import_shardopt()


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Element accesses per param element of one step: the least memory traffic of the update."""

    param: int  # reads + writes of the param
    grad: int  # reads of the grad
    state: int  # reads + writes of all per-element state tensors
    temp: int  # reads + writes of fp32 temporaries the algorithm cannot avoid
    note: str

    def bytes_per_param(self, param_size: int, grad_size: int, state_size: int) -> int:
        return (
            self.param * param_size
            + self.grad * grad_size
            + self.state * state_size
            + (self.temp * 4)
        )


TRAFFIC = {
    "adam": Traffic(
        param=2, grad=1, state=4, temp=0, note="read p,g,m,v; write p,m,v (fp32: 28 B/param)"
    ),
    "sgd": Traffic(
        param=2, grad=1, state=2, temp=0, note="read p,g,buf; write p,buf (fp32: 20 B/param)"
    ),
    "adagrad": Traffic(
        param=2, grad=1, state=2, temp=0, note="read p,g,sum; write p,sum (fp32: 20 B/param)"
    ),
    "lamb": Traffic(
        param=3,
        grad=2,
        state=6,
        temp=0,
        note="grad norm (clipping): read g; stage 1: read g,p,m,v, write m,v (sums of squares "
        "of p and u in the same pass, u not stored); stage 2: read p,m,v (u recomputed), write p "
        "(fp32: 44 B/param)",
    ),
    "lamb_noclip": Traffic(
        param=3,
        grad=1,
        state=6,
        temp=0,
        note="max_grad_norm=0: no grad-norm pass; stages 1 and 2 as lamb (fp32: 40 B/param)",
    ),
    "novograd": Traffic(
        param=2,
        grad=2,
        state=2,
        temp=0,
        note="per-tensor grad norms: read g; update: read g,p,m, write p,m (fp32: 24 B/param)",
    ),
}

SHARDOPT_CLASSES = {
    "adam": ("FusedAdam", {"weight_decay": 0.01}),
    "sgd": ("FusedSGD", {"momentum": 0.9}),
    "adagrad": ("FusedAdagrad", {}),
    "lamb": ("FusedLAMB", {"weight_decay": 0.01}),
    "lamb_noclip": ("FusedLAMB", {"weight_decay": 0.01, "max_grad_norm": 0.0}),
    "novograd": ("FusedNovoGrad", {}),
}

TORCH_CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.AdamW, {"weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {}),
}

LR = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# -- parameter sets -------------------------------------------------------------------------------


def gpt_shapes(vocab: int, positions: int, d: int, layers: int) -> list[tuple[int, ...]]:
    """GPT-2 style parameter shapes: embeddings, per layer qkv/proj/fc/fc2 + biases, layernorms."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (d,)]  # ln_1
        shapes += [(d, 3 * d), (3 * d,), (d, d), (d,)]  # attention qkv, proj
        shapes += [(d,), (d,)]  # ln_2
        shapes += [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # mlp fc, fc2
    shapes += [(d,), (d,)]  # ln_f
    return shapes


PARAM_SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2": lambda: gpt_shapes(vocab=50257, positions=1024, d=768, layers=12),
    "1.3b": lambda: gpt_shapes(vocab=50304, positions=2048, d=2048, layers=24),
    "flat": lambda: [(512 * 2**20,)],
    "cpu50m": lambda: [(50_000_000,)],
}
FP32_ONLY = {"flat", "cpu50m"}


def scaled(shapes: list[tuple[int, ...]], scale: float) -> list[tuple[int, ...]]:
    """Every dimension multiplied by ``scale`` (at least 1): small sets for quick checks."""
    if scale == 1.0:
        return shapes
    return [tuple(max(1, round(n * scale)) for n in shape) for shape in shapes]


def make_params(shapes, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Random params with preallocated random grads of the same dtype."""
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device))
        p.grad = torch.randn_like(p)
        params.append(p)
    return params


# -- measurement ----------------------------------------------------------------------------------


def state_size(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Element size of the per-element optimizer state actually allocated (param dtype if none)."""
    for p in params:
        for value in opt.state.get(p, {}).values():
            if torch.is_tensor(value) and value.shape == p.shape and value.numel() > 1:
                return value.element_size()
    return params[0].element_size()


def make_optimizer(algo: str, impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if impl == "shardopt":
        name, kwargs = SHARDOPT_CLASSES[algo]
        return getattr(shardopt, name)(params, lr=LR, **kwargs)
    cls, kwargs = TORCH_CLASSES[algo]
    flag = impl.removeprefix("torch_")
    return cls(params, lr=LR, **{flag: True}, **kwargs)


def measure(algo: str, impl: str, params, device, args) -> dict[str, Any]:
    """Median step time of one optimizer; an unsupported combination reports its error."""
    row: dict[str, Any] = {"optimizer": algo, "impl": impl}
    opt = None
    try:
        opt = make_optimizer(algo, impl, params)
        times = time_fn(
            opt.step,
            device,
            warmup=args.warmup,
            min_iters=args.min_iters,
            max_iters=args.max_iters,
            target_s=args.target_s,
        )
        ssize = state_size(opt, params)
    except Exception as exc:  # a torch fused kernel missing on this device, say
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        row["error"] = f"{type(exc).__name__}: {first_line}"
        return row
    finally:
        opt = None
        free_memory(device)
    numel = sum(p.numel() for p in params)
    per_param = TRAFFIC[algo].bytes_per_param(
        params[0].element_size(), params[0].grad.element_size(), ssize
    )
    ms = median(times)
    row.update(
        ms=ms,
        iters=len(times),
        min_ms=min(times),
        state_bytes=ssize,
        bytes_per_param=per_param,
        gbs=numel * per_param / ms / 1e6,
    )
    return row


def implementations(algo: str) -> list[str]:
    return ["shardopt"] + (["torch_fused", "torch_foreach"] if algo in TORCH_CLASSES else [])


def run_set(name: str, dtype_name: str, device, args, copy_gbs: float) -> list[dict[str, Any]]:
    shapes = scaled(PARAM_SETS[name](), args.scale)
    params = make_params(shapes, DTYPES[dtype_name], device)
    numel = sum(p.numel() for p in params)
    rows = []
    for algo in args.optimizers:
        base = None
        for impl in implementations(algo):
            row = {"set": name, "dtype": dtype_name, "numel": numel, "tensors": len(params)}
            row.update(measure(algo, impl, params, device, args))
            if "ms" in row:
                if impl == "shardopt":
                    base = row["ms"]
                row["vs_shardopt"] = row["ms"] / base if base else None
                row["of_copy"] = row["gbs"] / copy_gbs
            rows.append(row)
    del params
    free_memory(device)
    return rows


# -- report ---------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = ["set", "dtype", "optimizer", "impl", "ms", "GB/s", "of copy", "ms / shardopt", "B/p"]
    table = []
    errors = []
    for r in rows:
        table.append(
            [
                r["set"],
                r["dtype"],
                r["optimizer"],
                r["impl"],
                r.get("ms"),
                r.get("gbs"),
                r.get("of_copy"),
                r.get("vs_shardopt"),
                r.get("bytes_per_param"),
            ]
        )
        if "error" in r:
            errors.append(f"  {r['set']} {r['dtype']} {r['optimizer']} {r['impl']}: {r['error']}")
    print(format_table(headers, table))
    if errors:
        print("not measured:")
        print("\n".join(errors))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, read off the rows of this run."""
    by = {(r["set"], r["dtype"], r["optimizer"], r["impl"]): r for r in rows}
    lines = []
    for (set_name, dtype, algo, impl), r in by.items():
        if impl != "shardopt" or "ms" not in r:
            continue
        fused = by.get((set_name, dtype, algo, "torch_fused"), {})
        if "ms" in fused:
            lines.append(
                f"{set_name} {dtype} {algo}: torch fused / shardopt = "
                f"{fused['ms'] / r['ms']:.2f}x, shardopt at {100 * r['of_copy']:.1f}% of copy"
            )
        else:
            lines.append(
                f"{set_name} {dtype} {algo}: shardopt at {100 * r['of_copy']:.1f}% of copy"
            )
    return lines


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstring's layout."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="device to run on (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--sets",
        default=None,
        help="comma-separated parameter sets from "
        f"{','.join(PARAM_SETS)} (default: gpt2,1.3b,flat on cuda, cpu50m on cpu; "
        "flat is skipped on cpu at full scale)",
    )
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated param dtypes (fp32, bf16); flat and cpu50m are fp32 "
        "only (default: fp32,bf16 on cuda, fp32 on cpu)",
    )
    parser.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated from {','.join(TRAFFIC)} (default: all on cuda, "
        "adam,sgd,adagrad on cpu)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch intra-op threads on cpu"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer")
    parser.add_argument("--min-iters", type=int, default=5, help="fewest timed steps")
    parser.add_argument("--max-iters", type=int, default=50, help="most timed steps")
    parser.add_argument(
        "--target-s",
        type=float,
        default=None,
        help="timed seconds per optimizer, within the iteration bounds "
        "(default: 0.5 on cuda, 1.0 on cpu)",
    )
    parser.add_argument(
        "--copy-numel",
        type=int,
        default=None,
        help="fp32 elements of the copy-bandwidth buffer (default: 512Mi on cuda, 50M on cpu)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every dimension of the sets (quick checks with e.g. 0.05)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    if args.sets is None:
        args.sets = "cpu50m" if cpu else "gpt2,1.3b,flat"
    if args.dtypes is None:
        args.dtypes = "fp32" if cpu else "fp32,bf16"
    if args.optimizers is None:
        args.optimizers = "adam,sgd,adagrad" if cpu else ",".join(TRAFFIC)
    if args.target_s is None:
        args.target_s = 1.0 if cpu else 0.5
    if args.copy_numel is None:
        args.copy_numel = 50_000_000 if cpu else 512 * 2**20
    args.sets = [s for s in args.sets.split(",") if s]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    for values, known, what in (
        (args.sets, PARAM_SETS, "set"),
        (args.dtypes, DTYPES, "dtype"),
        (args.optimizers, TRAFFIC, "optimizer"),
    ):
        for v in values:
            if v not in known:
                parser.error(f"unknown {what} {v!r}; choose from {', '.join(known)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = environment(device)
    env["shardopt_cuda_kernels"] = shardopt.cuda_available()
    print(
        f"{env['date']}  {env['device_name']}  torch {env['torch']}  cuda {env['cuda']}  "
        f"commit {env['commit']}  threads {env['torch_threads']}  "
        f"shardopt cuda kernels: {env['shardopt_cuda_kernels']}"
    )
    copy = copy_bandwidth_gbs(device, args.copy_numel)
    print(
        f"copy bandwidth: {copy['gbs']:.1f} GB/s ({copy['bytes'] / 1e9:.2f} GB read + written "
        f"in {copy['ms']:.3f} ms)"
    )
    rows: list[dict[str, Any]] = []
    skipped = []
    for set_name in args.sets:
        if set_name == "flat" and device.type == "cpu" and args.scale == 1.0:
            skipped.append("flat (512M elements) on cpu")
            continue
        for dtype_name in args.dtypes:
            if set_name in FP32_ONLY and dtype_name != "fp32":
                continue
            rows += run_set(set_name, dtype_name, device, args, copy["gbs"])
    print_table(rows)
    if skipped:
        print("skipped: " + "; ".join(skipped))
    lines = summary(rows)
    print("\n".join(lines))
    write_json(
        args.out,
        {
            "environment": env,
            "args": {k: v for k, v in vars(args).items()},
            "copy": copy,
            "traffic": {k: dataclasses.asdict(v) for k, v in TRAFFIC.items()},
            "results": rows,
            "summary": lines,
        },
    )


if __name__ == "__main__":
    main()
