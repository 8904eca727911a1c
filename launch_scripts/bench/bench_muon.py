"""Muon optimizer step on one GPU: shardopt.FusedMuon against torch.optim.Muon and the peers, and
the Newton-Schulz part against the bf16 GEMM ceiling measured in the same run.

For each parameter set (bench_muon_sets.py: the 124M and 1.3B GPT sets, Llama-8B-shaped layers),
fp32 params with preallocated random grads, 2-D hidden weights to Muon and the rest to AdamW:

- step: the median step of each contender (bench_muon_contenders.py; heavyball compiled and
  DeepSpeed ZeRO-2 in subprocesses, bench_muon_worker.py), CUDA events after warm-up, and its
  time over torch.optim.Muon + torch fused AdamW's in the same run;
- ns: Newton-Schulz alone (bench_muon_ns.py) over the set's matrices stacked by shape in bf16,
  in TFLOP/s counting ``20 n²m + 10 n³`` per n x m matrix (n <= m) for 5 steps, over the rate of
  an 8192³ bf16 matmul and of the same products as plain ``bmm``.

Every contender is optional: one that is not installed or fails is reported and the rest goes
on; a time budget skips what would start after it. Each measurement is one JSON line (stdout and
``--jsonl``); the end prints markdown tables (``--md``) and writes everything to ``--out``::

    python launch_scripts/bench/bench_muon.py --out muon.json --md muon.md --jsonl muon.jsonl
    python launch_scripts/bench/bench_muon.py --device cpu --tiny     # toy sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import environment, free_memory, import_shardopt, median, time_fn, write_json
from bench_muon_contenders import (
    CONTENDERS,
    DISTRIBUTIONS,
    IN_PROCESS,
    SUBPROCESS,
    Unavailable,
    grads_lost,
    gram_option,
    version,
)
from bench_muon_ns import gemm_square, measure_ns
from bench_muon_report import markdown, summary
from bench_muon_sets import (
    SETS,
    describe,
    make_params,
    matrix_stacks,
    moved,
    set_specs,
    snapshot,
)

shardopt = import_shardopt()
from shardopt.algorithms import muon as muon_alg  # noqa: E402  (after the source-tree fallback)

HERE = Path(__file__).resolve().parent


class Budget:
    """Wall-clock seconds left for this run; what would start after the end is skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Recorder:
    """Collects rows; prints each as one JSON line and appends it to ``--jsonl`` at once, so a
    run cut short keeps what it measured."""

    def __init__(self, jsonl: str | None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.path = Path(jsonl) if jsonl else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        line = json.dumps(row, default=str)
        print(line, flush=True)
        if self.path:
            with self.path.open("a") as f:
                f.write(line + "\n")


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def measure_step(name: str, params: tuple[list, list], device, timing) -> dict[str, Any]:
    """One in-process contender's median step; its error where it cannot run."""
    row: dict[str, Any] = {"contender": name}
    precision = torch.get_float32_matmul_precision()
    step = None
    try:
        step, _ = IN_PROCESS[name](shardopt, *params)
        before = snapshot(params[0])
        times = time_fn(step, device, **timing)
        row.update(
            ms=median(times), min_ms=min(times), iters=len(times), moved=moved(params[0], before)
        )
        lost = grads_lost(params)
        if lost:
            row["error"] = lost
            row["invalid_ms"] = row.pop("ms")
    except Unavailable as exc:
        row["error"] = f"unavailable: {exc}"
    except Exception as exc:  # out of memory, a peer's bug at these shapes
        row["error"] = _error(exc)
    finally:
        # a peer that changes the matmul precision must not change the next one's
        torch.set_float32_matmul_precision(precision)
        step = None  # the optimizers and their state go with the step's closure
        free_memory(device)
    return row


def run_worker(peer: str, args: argparse.Namespace, seconds: float) -> list[dict[str, Any]]:
    """The rows of one subprocess peer, within ``seconds``; sets it did not reach say why."""
    cmd = [
        sys.executable,
        str(HERE / "bench_muon_worker.py"),
        "--peer",
        peer,
        "--sets",
        ",".join(args.sets),
        "--llama-layers",
        str(args.llama_layers),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--warmup",
        str(args.warmup),
        "--min-iters",
        str(args.min_iters),
        "--max-iters",
        str(args.max_iters),
        "--target-s",
        str(args.target_s),
    ]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--deepspeed-fused-adam"] if args.deepspeed_fused_adam else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    # DeepSpeed's op builder reads this as numbers ("9.0a" fails)
    env["TORCH_CUDA_ARCH_LIST"] = env.get("TORCH_CUDA_ARCH_LIST", "9.0").replace("a", "")
    note = None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, env=env)
        out, err = done.stdout, done.stderr
        if done.returncode:
            note = f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        note = f"killed at the time limit ({seconds:.0f} s)"
    rows = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    tail = [line for line in err.strip().splitlines() if line.strip()][-1:] if err else []
    reached = {r["set"] for r in rows}
    for set_name in args.sets:
        if set_name not in reached:
            reason = note or "no result"
            rows.append(
                {
                    "kind": "step",
                    "set": set_name,
                    "contender": peer,
                    "error": f"{reason}: {tail[0][:300] if tail else ''}",
                }
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    budget = Budget(args.budget_s)
    timing = {
        "warmup": args.warmup,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "target_s": args.target_s,
    }
    env = environment(device)
    env["shardopt_cuda_kernels"] = shardopt.cuda_available()
    env["shardopt_version"] = getattr(shardopt, "__version__", None)
    env["fused_gram_option"] = gram_option()
    env["versions"] = {c: version(DISTRIBUTIONS[c]) for c in args.contenders}
    print(
        f"{env['date']}  {env['device_name']}  torch {env['torch']}  cuda {env['cuda']}  "
        f"commit {env['commit']}  shardopt cuda kernels: {env['shardopt_cuda_kernels']}  "
        f"gram option: {env['fused_gram_option']}",
        flush=True,
    )
    rec = Recorder(args.jsonl)
    gemm = {"kind": "gemm", "what": f"mm {args.gemm_n}^3"}
    try:
        gemm = gemm_square(args.gemm_n, device, timing)
    except Exception as exc:  # out of memory on a small card
        gemm["error"] = _error(exc)
    rec.add(gemm)
    for set_name in args.sets:
        specs = set_specs(set_name, args.tiny, args.llama_layers)
        info = describe(specs)
        stacks = matrix_stacks(specs)
        if budget.left() < args.reserve_s:
            rec.add({"kind": "ns", "set": set_name, "error": "skipped: time budget"})
        elif "ns" in args.parts:
            for row in measure_ns(set_name, stacks, device, timing, muon_alg, gemm.get("tflops")):
                rec.add({**row, "stacks": stacks})
        if "step" not in args.parts:
            continue
        params = make_params(specs, device)
        torch_ms = None
        for name in (c for c in args.contenders if c in IN_PROCESS):
            if budget.left() < args.reserve_s:
                row = {"contender": name, "error": "skipped: time budget"}
            else:
                row = measure_step(name, params, device, timing)
            row = {"kind": "step", "set": set_name, **info, **row}
            if name == "torch":
                torch_ms = row.get("ms")
            if torch_ms and row.get("ms"):
                row["vs_torch"] = row["ms"] / torch_ms
            rec.add(row)
        params = None
        free_memory(device)
    if "step" in args.parts:
        for peer in (c for c in args.contenders if c in SUBPROCESS):
            seconds = min(args.peer_timeout_s, budget.left() - args.reserve_s)
            if seconds < 10:
                rows = [
                    {"kind": "step", "set": s, "contender": peer, "error": "skipped: time budget"}
                    for s in args.sets
                ]
            else:
                rows = run_worker(peer, args, seconds)
            for row in rows:
                base = next(
                    (
                        r.get("ms")
                        for r in rec.rows
                        if r.get("kind") == "step"
                        and r["set"] == row["set"]
                        and r["contender"] == "torch"
                    ),
                    None,
                )
                if base and row.get("ms"):
                    row["vs_torch"] = row["ms"] / base
                rec.add(row)
    return {"environment": env, "args": vars(args), "rows": rec.rows}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstring's layout."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any"
    )
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated from {list(SETS)}")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma-separated from {CONTENDERS}"
    )
    parser.add_argument("--parts", default="ns,step", help="ns, step or both")
    parser.add_argument("--llama-layers", type=int, default=4, help="Llama-8B-shaped layers")
    parser.add_argument("--tiny", action="store_true", help="toy sizes of every set (CPU checks)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads on cpu (default: 1 with --tiny)"
    )
    parser.add_argument("--budget-s", type=float, default=230.0, help="wall-clock budget")
    parser.add_argument(
        "--reserve-s", type=float, default=5.0, help="nothing starts with less than this left"
    )
    parser.add_argument(
        "--peer-timeout-s", type=float, default=80.0, help="time limit of each subprocess peer"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps (default 3; tiny 1)"
    )
    parser.add_argument("--min-iters", type=int, default=None, help="fewest timed (5; tiny 2)")
    parser.add_argument("--max-iters", type=int, default=None, help="most timed (30; tiny 3)")
    parser.add_argument("--target-s", type=float, default=None, help="timed s each (0.4; tiny 0)")
    parser.add_argument(
        "--gemm-n", type=int, default=None, help="the ceiling's matmul (8192; tiny 256)"
    )
    parser.add_argument(
        "--deepspeed-fused-adam",
        action="store_true",
        help="DeepSpeed's AdamW half as its FusedAdam (a JIT build) instead of torch's AdamW",
    )
    parser.add_argument("--out", default=None, help="write environment and rows as JSON here")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per measurement here")
    parser.add_argument("--md", default=None, help="write the markdown tables here")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.threads is None:
        # toy matrices on a shared 2-core machine: a second thread only spins
        args.threads = 1 if args.tiny else os.cpu_count()
    small = args.tiny
    for key, full, tiny in (
        ("warmup", 3, 1),
        ("min_iters", 5, 2),
        ("max_iters", 30, 3),
        ("target_s", 0.4, 0.0),
        ("gemm_n", 8192, 256),
    ):
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else full)
    args.sets = [s for s in args.sets.split(",") if s]
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.parts = [p for p in args.parts.split(",") if p]
    for values, known, what in (
        (args.sets, SETS, "set"),
        (args.contenders, CONTENDERS, "contender"),
        (args.parts, ("ns", "step"), "part"),
    ):
        for v in values:
            if v not in known:
                parser.error(f"unknown {what} {v!r}; choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = run(args)
    table = markdown(result)
    lines = summary(result["rows"])
    print("\n" + table + "\n\n" + "\n".join(lines))
    result["summary"] = lines
    write_json(args.out, result)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(table + "\n\n" + "\n".join(f"- {s}" for s in lines) + "\n")


if __name__ == "__main__":
    main()
