"""CPU step time of each prebuilt ISA module against the JIT (-march=native) build and torch fused.

    python setup.py build_ext --inplace       # the ISA modules (shardopt._C, _C_avx2, _C_avx512)
    PYTHONPATH=. python launch_scripts/bench/bench_cpu_isa.py --numel 1000000 --rounds 301
    PYTHONPATH=. python launch_scripts/bench/bench_cpu_isa.py --numel 50000000 --rounds 21

One optimizer object per algorithm whose CPU module is swapped every round (round robin over the
modules this CPU runs, the JIT build and torch.optim's fused kernel on its own copy), so that load
from other processes hits every contender alike; prints the minimum and median step time of each.
The JIT build is cached in $SHARDOPT_BUILD_DIR (built on first use, about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shardopt
from shardopt.kernels import build, cpu_isa, jit, loader

ALGOS = {
    "adam": (shardopt.FusedAdam, torch.optim.AdamW, {"weight_decay": 0.01}),
    "sgd": (shardopt.FusedSGD, torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": (shardopt.FusedAdagrad, torch.optim.Adagrad, {}),
}


def modules() -> dict[str, object]:
    detected = cpu_isa.detect_cpu_capability()
    out = {}
    for cap, name, _ in build.cpu_isa_levels():
        if cpu_isa.CAPABILITIES.index(cap) <= cpu_isa.CAPABILITIES.index(detected):
            out[name] = loader.extension() if name == "_C" else loader._import_prebuilt(name)
    out["jit_native"] = jit.jit_build()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1_000_000, help="fp32 params (one tensor)")
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--algos", default="adam,sgd,adagrad")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mods = modules()
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.numel} fp32 params, "
        f"{args.rounds} rounds, CPU {cpu_isa.detect_cpu_capability()}"
    )
    for algo in args.algos.split(","):
        ours, theirs, kwargs = ALGOS[algo]

        def params() -> list[torch.Tensor]:
            p = torch.randn(args.numel)
            p.grad = torch.randn(args.numel)
            return [p]

        opt, ref = (
            ours(params(), lr=1e-3, **kwargs),
            theirs(params(), lr=1e-3, fused=True, **kwargs),
        )
        for _ in range(3):
            opt.step()
            ref.step()
        times: dict[str, list[float]] = {name: [] for name in [*mods, "torch_fused"]}
        for _ in range(args.rounds):
            for name, module in mods.items():
                loader._CPU = module
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            ref.step()
            times["torch_fused"].append(time.perf_counter() - start)
        base = statistics.median(times["torch_fused"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{algo:8s} {name:12s} min {min(ts) * 1e6:9.0f} us  median {med * 1e6:9.0f} us"
                f"  torch_fused / this {base / med:5.2f}"
            )
    loader._CPU = None


if __name__ == "__main__":
    main()
