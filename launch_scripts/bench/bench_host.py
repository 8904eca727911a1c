"""Host overhead of the single-process step: every fused class on many small tensors.

Per class, the median step on the GPT-2 124M tensor set (bench_kernels.py's shapes: 148 tensors),
on 1,000 tiny tensors or on four 4M-element tensors (``16m``, where a CPU step is bound by bytes),
against torch.optim's fused optimizer where one exists, in fp32 and bf16. The contenders take
turns step by step, so load from other processes hits them alike.

- GPU: each timed step starts on an idle device (synchronize before it); ``step ms`` is the
  time between CUDA events recorded around it (device work plus any wait for the host to issue
  it: a host-bound step shows its host cost here), ``host ms`` the time the ``step()`` call holds
  the CPU. With ``--graph`` (the default on a GPU) every contender is also captured in a CUDA
  graph after warm-up and its replays are timed the same way: shardopt's ``capturable=True``
  FusedAdam and FusedLAMB, FusedMixedPrecisionLamb and torch's ``capturable=True`` AdamW replay
  real steps; the classes without a capturable mode replay the host lr and step of the captured
  step (timing only), and a contender whose capture fails reports why.
- CPU: ``perf_counter`` around each step (``step ms`` is the host time).

On a GPU the run first measures the device copy bandwidth (bench_common.copy_bandwidth_gbs), and
each row's "of copy" is the effective bandwidth of its step (the bytes the update must move, the
B/p column, bench_kernels.py's convention, from the dtypes each optimizer actually keeps) over it.
The output is one line per (dtype, optimizer, implementation), eager and graph side by side, and
one line per contender that could not be measured; ``--out`` writes every number as JSON.

::

    python launch_scripts/bench/bench_host.py --out bench_host.json  # GPU: gpt2 fp32, bf16
    python launch_scripts/bench/bench_host.py --device cpu --threads 1 --scale 0.01  # CPU: small
    python launch_scripts/bench/bench_host.py --device cpu --threads 1 --set tiny
    python launch_scripts/bench/bench_host.py --device cpu --threads 2 --set 16m --rounds 31
    python launch_scripts/bench/bench_host.py --device cpu --threads 1 --scale 0.01 --profile adam
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_common import (
    copy_bandwidth_gbs,
    environment,
    format_table,
    free_memory,
    median,
    write_json,
)
from bench_kernels import gpt_shapes, make_params, scaled, shardopt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2": lambda: gpt_shapes(vocab=50257, positions=1024, d=768, layers=12),
    "tiny": lambda: [(64,)] * 1000,
    "16m": lambda: [(4_000_000,)] * 4,  # bound by bytes on a CPU: LAMB and NovoGrad against Adam
}
LR = 1e-3

# name -> (shardopt class, its kwargs, torch class or None, torch kwargs)
CLASSES: dict[str, tuple[str, dict, type | None, dict]] = {
    "adam": ("FusedAdam", {"weight_decay": 0.01}, torch.optim.AdamW, {"weight_decay": 0.01}),
    "sgd": ("FusedSGD", {"momentum": 0.9}, torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": ("FusedAdagrad", {}, torch.optim.Adagrad, {}),
    "lamb": ("FusedLAMB", {"weight_decay": 0.01}, None, {}),
    "lamb_noclip": ("FusedLAMB", {"weight_decay": 0.01, "max_grad_norm": 0.0}, None, {}),
    "novograd": ("FusedNovoGrad", {}, None, {}),
    "mp_lamb": ("FusedMixedPrecisionLamb", {"weight_decay": 0.01}, None, {}),
}
CAPTURABLE = {"adam", "lamb", "lamb_noclip"}  # with a capturable flag (mp_lamb always is)

# Element accesses per param element of one step (bench_kernels.py's TRAFFIC): (grad reads, reads +
# writes of the param the math updates (the fp32 master where there is one), reads + writes of
# each element of per-element state summed over the state tensors). A low-precision param with a
# master is written once more (the rounded copy). LAMB with clipping reads the grads twice (the
# global norm, then stage 1): fp32 44 B/param, 40 without; NovoGrad reads them twice too (the
# per-tensor norms, then the update): fp32 24 B/param.
ACCESSES = {
    "adam": (1, 2, 4),
    "sgd": (1, 2, 2),
    "adagrad": (1, 2, 2),
    "lamb": (2, 3, 6),
    "lamb_noclip": (1, 3, 6),
    "novograd": (2, 2, 2),
    "mp_lamb": (2, 3, 6),
}


def bytes_per_param(algo: str, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """The bytes one step must move per param element, from the dtypes ``opt`` keeps (after a
    step: its state exists)."""
    grad_reads, param_accesses, state_accesses = ACCESSES[algo]
    p = max(params, key=lambda t: t.numel())
    state = opt.state.get(p, {})
    master = state.get("master_param")
    math_size = master.element_size() if torch.is_tensor(master) else p.element_size()
    state_size = next(
        (
            v.element_size()
            for k, v in state.items()
            if k != "master_param" and torch.is_tensor(v) and v.shape == p.shape
        ),
        p.element_size(),
    )
    return (
        grad_reads * p.grad.element_size()
        + param_accesses * math_size
        + state_accesses * state_size
        + (p.element_size() if torch.is_tensor(master) else 0)
    )


def make(algo: str, impl: str, params: list[torch.Tensor], graph: bool) -> torch.optim.Optimizer:
    name, kwargs, torch_cls, torch_kwargs = CLASSES[algo]
    if impl == "torch_fused":
        extra = {"capturable": True} if graph and algo == "adam" else {}
        return torch_cls(params, lr=LR, fused=True, **torch_kwargs, **extra)
    kwargs = dict(kwargs)
    if graph and algo in CAPTURABLE:
        kwargs["capturable"] = True
    if algo == "mp_lamb" and params[0].dtype == torch.bfloat16:
        kwargs["reduced_precision_dtype"] = torch.bfloat16  # fp32 masters, its purpose
    lr: Any = LR
    if graph and algo in CAPTURABLE:
        lr = torch.tensor(LR, device=params[0].device)  # read on the device by a replay
    return getattr(shardopt, name)(params, lr=lr, **kwargs)


class Contender:
    """One optimizer on its own params; ``run()`` is one step (eager) or one graph replay."""

    def __init__(self, algo: str, impl: str, shapes, dtype, device, graph: bool, warmup: int):
        self.algo, self.impl, self.graph = algo, impl, graph
        self.params = make_params(shapes, dtype, device)
        self.opt = make(algo, impl, self.params, graph)
        self.cuda = device.type == "cuda"
        self.run: Callable[[], Any] = self.opt.step
        self.device_ms: list[float] = []
        self.host_ms: list[float] = []
        self._events: list[tuple[Any, Any]] = []
        if not graph:
            for _ in range(warmup):
                self.opt.step()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
            for _ in range(warmup):
                self.opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.cuda_graph):
            self.opt.step()
        self.run = self.cuda_graph.replay

    def timed(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # an empty queue: the host time is not spent waiting on it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        self.run()
        self.host_ms.append((time.perf_counter() - begin) * 1e3)
        if self.cuda:
            end.record()
            self._events.append((start, end))

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.device_ms = [s.elapsed_time(e) for s, e in self._events]
        else:
            self.device_ms = self.host_ms
        self.bytes_per_param = bytes_per_param(self.algo, self.opt, self.params)


def impls(algo: str, device: torch.device) -> list[str]:
    torch_cls = CLASSES[algo][2]
    if torch_cls is None or (torch_cls is torch.optim.Adagrad and device.type == "cuda"):
        return ["shardopt"]  # torch has no fused Adagrad on CUDA
    return ["shardopt", "torch_fused"]


def run_mode(
    set_name: str, dtype_name: str, graph: bool, device, args, copy_gbs: float | None
) -> list[dict[str, Any]]:
    shapes = scaled(SETS[set_name](), args.scale)
    numel = sum(_numel(s) for s in shapes)
    dtype = DTYPES[dtype_name]
    contenders, rows = [], []
    for algo in args.classes:
        for impl in impls(algo, device):
            row = {"set": set_name, "dtype": dtype_name, "optimizer": algo, "impl": impl}
            row.update(mode="graph" if graph else "eager", tensors=len(shapes), numel=numel)
            try:
                contenders.append((row, Contender(algo, impl, shapes, dtype, device, graph, 3)))
            except Exception as exc:  # e.g. a torch optimizer that refuses capture
                first = str(exc).splitlines()[0] if str(exc) else ""
                row["error"] = f"{type(exc).__name__}: {first[:120]}"
            rows.append(row)
    for _ in range(args.rounds):
        for _, c in contenders:
            c.timed()
    for row, c in contenders:
        c.finish()
        ms = median(c.device_ms)
        row.update(ms=ms, host_ms=median(c.host_ms), min_ms=min(c.device_ms))
        row.update(bytes_per_param=c.bytes_per_param, gbs=numel * c.bytes_per_param / ms / 1e6)
        if copy_gbs:
            row["of_copy"] = row["gbs"] / copy_gbs
    base = {r["optimizer"]: r["ms"] for r in rows if r["impl"] == "shardopt" and "ms" in r}
    for r in rows:
        if "ms" in r and base.get(r["optimizer"]):
            r["vs_shardopt"] = r["ms"] / base[r["optimizer"]]
    contenders.clear()
    free_memory(device)
    return rows


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per (set, dtype, optimizer, impl): eager and graph side by side; then one line
    per contender that was not measured."""
    merged: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["set"], r["dtype"], r["optimizer"], r["impl"])
        merged.setdefault(key, {})[r["mode"]] = r
    headers = ["set", "dtype", "optimizer", "impl", "B/p", "eager ms", "host ms", "of copy"]
    headers += ["/ ours", "graph ms", "of copy", "/ ours"]
    table = []
    for (set_name, dtype, algo, impl), modes in merged.items():
        eager, graph = modes.get("eager", {}), modes.get("graph", {})
        bpp = eager.get("bytes_per_param", graph.get("bytes_per_param"))
        table.append(
            [set_name, dtype, algo, impl, bpp, eager.get("ms"), eager.get("host_ms")]
            + [_pct(eager.get("of_copy")), eager.get("vs_shardopt"), graph.get("ms")]
            + [_pct(graph.get("of_copy")), graph.get("vs_shardopt")]
        )
    print(format_table(headers, table))
    for r in rows:
        if "error" in r:
            print(f"not measured: {r['mode']} {r['optimizer']} {r['impl']}: {r['error']}")


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def profile(algo: str, device: torch.device, args) -> None:
    """``cProfile`` of 500 steps of one shardopt class (after warm-up): where the host time goes."""
    import cProfile
    import pstats

    shapes = scaled(SETS[args.set](), args.scale)
    c = Contender(algo, "shardopt", shapes, DTYPES[args.dtypes[0]], device, False, 3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        c.opt.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--set", choices=list(SETS), default="gpt2")
    parser.add_argument("--dtypes", default=None, help="fp32,bf16 (default: both on cuda)")
    parser.add_argument("--classes", default=",".join(CLASSES), help="from " + ",".join(CLASSES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every dimension")
    parser.add_argument("--rounds", type=int, default=200, help="timed steps per contender")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (cpu)")
    parser.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time CUDA-graph replays (default: on with cuda)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="CLASS",
        help="instead of timing, cProfile 500 steps of this shardopt class (first dtype)",
    )
    parser.add_argument(
        "--copy-numel",
        type=int,
        default=512 * 2**20,
        help="fp32 elements of the copy-bandwidth buffer (GPU)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtypes is None:
        args.dtypes = "fp32,bf16" if args.device == "cuda" else "fp32"
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.classes = [c for c in args.classes.split(",") if c]
    for c in args.classes + ([args.profile] if args.profile else []):
        if c not in CLASSES:
            parser.error(f"unknown class {c!r}; choose from {', '.join(CLASSES)}")
    if args.graph is None:
        args.graph = args.device == "cuda"
    if args.graph and args.device != "cuda":
        parser.error("--graph needs --device cuda")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("once")  # a warning per contender and step would swamp the table
    env = environment(device)
    print(
        f"{env['date']}  {env['device_name']}  torch {env['torch']}  commit {env['commit']}  "
        f"threads {env['torch_threads']}  set {args.set} (scale {args.scale}), "
        f"{args.rounds} rounds"
    )
    if args.profile:
        profile(args.profile, device, args)
        return
    copy = None
    if device.type == "cuda":
        copy = copy_bandwidth_gbs(device, args.copy_numel)
        print(
            f"copy bandwidth {copy['gbs']:,.0f} GB/s ({copy['bytes'] / 1e9:.2f} GB in "
            f"{copy['ms']:.3f} ms)"
        )
    rows = []
    for dtype_name in args.dtypes:
        for graph in [False, True] if args.graph else [False]:
            rows += run_mode(args.set, dtype_name, graph, device, args, copy and copy["gbs"])
    print_table(rows)
    write_json(args.out, {"environment": env, "args": vars(args), "copy": copy, "results": rows})


if __name__ == "__main__":
    main()
