"""CPU offload side by side on one GPU: shardopt's offload against no offload and the peers.

    python launch_scripts/bench/bench_offload.py --out bench_offload.json  # 1.4B and 2.8B
    python launch_scripts/bench/bench_offload.py --width 2048 --depth 24 --clip on
    python launch_scripts/bench/bench_offload.py --largest --budget-s 300 --out largest.json
    python launch_scripts/bench/bench_offload.py --device cpu --width 64 --depth 2 --seq 32 \\
        --vocab 128

Per model size (``--sizes`` WIDTHxDEPTH, or ``--width`` and ``--depth``) every contender of
bench_offload_peers.py runs in a fresh subprocess (bench_offload_worker.py), with and without
grad clipping (max norm 1.0) in the same process (shardopt offload: one process per setting,
updating during backward only without clipping, ``CPUOffload(overlap_backward=...)``). Batch
4 x 2048 tokens, random tokens, AdamW.
Printed: a markdown table (step ms, ratio against no offload and against DeepSpeed's offload at
the same clip setting, GPU peak, host RSS, host bytes per param, tokens/s) and the full-offload
target: step <= 1.1x max(forward+backward, CPU update). A contender that cannot run here prints
one line "skipped: <reason>" and the others run; ``--budget-s`` bounds the whole run (contenders
and attempts that no longer fit are recorded as skipped).

Modules: bench_offload_peers.py (the contenders), bench_offload_worker.py (one contender in one
process), bench_offload_search.py (``--largest``), bench_offload_report.py (tables, targets).

``--largest``: per contender of ``--largest-contenders`` the largest GPT at ``--largest-width``
that trains (bench_offload_search.py), with activation checkpointing and batch
``--largest-batch``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import environment, write_json
from bench_offload_peers import CONTENDERS, GPU_ONLY, TIMING_ONLY, count_params, model_config
from bench_offload_report import full_offload_target, largest_table, one_line, table
from bench_offload_search import search
from bench_offload_worker import RESULT_PREFIX, Spec, measure

HERE = Path(__file__).resolve().parent
DEFAULT_CONTENDERS = [c for c in CONTENDERS if c != "offload_compact"]
#: seconds a contender needs at the least to be worth starting
MIN_CONTENDER_S = 20.0


class Runner:
    """Runs workers (subprocesses, or in this process with ``in_process``) under one deadline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.in_process = args.in_process
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        self.timeout_s = args.contender_timeout_s
        budget = args.budget_s if args.budget_s is not None else float("inf")
        self.deadline = time.monotonic() + budget
        self.count = 0
        self.worker: subprocess.Popen | None = None

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def __call__(self, spec: Spec, timeout_s: float | None = None) -> dict[str, Any]:
        timeout = min(timeout_s or self.timeout_s, self.left_s())
        cfg = model_config(spec.width, spec.depth, spec.vocab, spec.seq)
        base = {
            "contender": spec.contender,
            "width": spec.width,
            "depth": spec.depth,
            "params": count_params(cfg),  # (also for an attempt that timed out or was killed)
        }
        if timeout < MIN_CONTENDER_S:
            return {**base, "skipped": "time budget spent"}
        self.count += 1
        if self.in_process:
            return {**measure(spec), "in_process": True}
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            clips = "".join("c" if c else "n" for c in spec.clips)
            log = (
                self.log_dir
                / f"{self.count:02d}_{spec.contender}_{spec.width}x{spec.depth}_{clips}.log"
            )
        cmd = [
            sys.executable,
            str(HERE / "bench_offload_worker.py"),
            json.dumps(dataclasses.asdict(spec)),
        ]
        # its own process group, so that a timeout also ends what it started (DeepSpeed's op
        # build); the same session, so that whatever ends this run ends it too
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0
        )
        self.worker = proc
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_worker()
            stdout, stderr = proc.communicate()
            self._log(log, stdout, stderr)
            return {**base, "error": f"timed out after {timeout:.0f} s"}
        finally:
            self.worker = None
        self._log(log, stdout, stderr)
        for line in reversed(stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
        tail = (stderr or "").strip().splitlines()[-1:] or [""]
        if proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} (the host's OOM killer sends 9)"
        else:
            why = f"exit code {proc.returncode}: {tail[0]}"
        return {**base, "error": why}

    def kill_worker(self) -> None:
        """Ends the running worker's process group (the worker and what it started)."""
        if self.worker is not None and self.worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.worker.pid, signal.SIGKILL)

    @staticmethod
    def _log(path: Path | None, stdout: Any, stderr: Any) -> None:
        if path is None:
            return

        def text(x: Any) -> str:
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

        path.write_text(text(stdout) + "\n--- stderr ---\n" + text(stderr))


# -- one size -------------------------------------------------------------------------------------


def worker_specs(name: str, args: argparse.Namespace, width: int, depth: int) -> list[Spec]:
    """The worker processes of contender ``name`` (one per clip setting for shardopt offload)."""
    base = Spec(
        contender=name,
        device=args.device,
        width=width,
        depth=depth,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
        warmup=args.auto_warmup if name == "offload_auto" else args.warmup,
        steps=args.steps,
        clips=(False,) if name in TIMING_ONLY else args.clips,
        max_norm=args.max_norm,
        threads=args.threads,
        checkpointing=args.checkpointing,
    )
    if name in ("offload", "offload_auto", "offload_compact") and len(base.clips) > 1:
        return [dataclasses.replace(base, clips=(c,)) for c in base.clips]
    return [base]


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's record from its workers' (the phases of all, the rest of the first)."""
    if len(records) == 1:
        return records[0]
    merged = dict(records[0])
    merged["phases"] = [p for r in records for p in r.get("phases", [])]
    merged["workers"] = records
    return merged


def run_size(args: argparse.Namespace, runner: Runner, width: int, depth: int) -> dict[str, Any]:
    cfg = model_config(width, depth, args.vocab, args.seq)
    result: dict[str, Any] = {
        "width": width,
        "depth": depth,
        "heads": cfg.n_head,
        "params": count_params(cfg),
        "contenders": {},
    }
    args.report.setdefault("sizes", []).append(result)  # written after each contender
    print(f"\n## GPT {width} x {depth} ({result['params'] / 1e9:.2f}B params)", flush=True)
    for name in args.contenders:
        if name in GPU_ONLY and args.device != "cuda":
            record = {"contender": name, "skipped": f"{name} needs a CUDA device"}
        else:
            records = []
            for spec in worker_specs(name, args, width, depth):
                records.append(runner(spec))
                if "skipped" in records[-1]:  # the next clip setting would skip alike
                    break
            record = merge(records)
        result["contenders"][name] = record
        print(f"{name}: {one_line(record)}", flush=True)
        if args.out:
            write_json(args.out, args.report)
    result["target"] = full_offload_target(result["contenders"])
    print(table(result["contenders"]))
    for line in result["target"]["lines"]:
        print(line)
    return result


# -- largest --------------------------------------------------------------------------------------


def run_largest(args: argparse.Namespace, runner: Runner) -> list[dict[str, Any]]:
    print(f"\n## Largest GPT that trains (width {args.largest_width})", flush=True)
    results = []
    names = args.largest_contenders
    for i, name in enumerate(names):
        if name in GPU_ONLY and args.device != "cuda":
            results.append({"contender": name, "width": args.largest_width, "stopped": "skipped",
                            "largest": None, "first_failure": None, "attempts": [],
                            "skipped": f"{name} needs a CUDA device"})  # fmt: skip
            print(f"{name}: skipped: {name} needs a CUDA device")
            continue
        share = runner.left_s() / (len(names) - i)
        base = Spec(
            contender=name,
            device=args.device,
            width=args.largest_width,
            depth=1,
            vocab=args.vocab,
            seq=args.seq,
            batch=args.largest_batch,
            warmup=0,
            steps=args.largest_steps,
            clips=(True,),
            max_norm=args.max_norm,
            threads=args.threads,
            checkpointing=True,
        )
        start = args.largest_start.get(name, args.largest_start.get("*", 32))
        results.append(
            search(
                base,
                runner,
                start=start,
                step=args.largest_step,
                max_depth=args.largest_max_depth,
                resolution=args.largest_resolution,
                deadline=time.monotonic() + share,
                attempt_timeout_s=args.attempt_timeout_s,
            )
        )
        if args.out:
            args.report["largest"] = results
            write_json(args.out, args.report)
    print(largest_table(results))
    return results


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present"
    )
    p.add_argument(
        "--sizes", default="2048x24,2560x32", help="model sizes, WIDTHxDEPTH, comma-separated"
    )
    p.add_argument(
        "--width", type=int, default=None, help="with --depth: one size instead of --sizes"
    )
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="default: 50304 (cpu: 512)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence; 2048 (cpu: 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument(
        "--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"from {','.join(CONTENDERS)}"
    )
    p.add_argument("--clip", choices=["off", "on", "both"], default="both", help="grad clipping")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per clip setting")
    p.add_argument("--auto-warmup", type=int, default=5, help="untimed steps of offload_auto")
    p.add_argument("--steps", type=int, default=5, help="timed steps per clip setting")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing per block"
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="wall-clock budget of the whole run"
    )
    p.add_argument("--contender-timeout-s", type=float, default=300)
    p.add_argument("--in-process", action="store_true", help="no subprocesses (memory numbers mix)")
    p.add_argument("--log-dir", default=None, help="each worker's output goes to a file here")
    p.add_argument("--out", default=None, help="JSON results (rewritten after each contender)")
    p.add_argument("--largest", action="store_true", help="the largest-model search instead")
    p.add_argument("--largest-width", type=int, default=4096)
    p.add_argument("--largest-contenders", default="offload,offload_compact,deepspeed_offload")
    p.add_argument("--largest-start", default="offload=44,offload_compact=100,deepspeed_offload=24",
                   help="first depth per contender (NAME=DEPTH, '*=' for the rest)")  # fmt: skip
    p.add_argument("--largest-step", type=int, default=8, help="depth step before bisecting")
    p.add_argument("--largest-resolution", type=int, default=2, help="bisect down to this gap")
    p.add_argument("--largest-max-depth", type=int, default=256)
    p.add_argument("--largest-batch", type=int, default=1)
    p.add_argument("--largest-steps", type=int, default=2, help="steps an attempt must train")
    p.add_argument("--attempt-timeout-s", type=float, default=240)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"  # a CPU run is a check of the benchmark: small defaults
    args.vocab = args.vocab or (512 if cpu else 50304)
    args.seq = args.seq or (64 if cpu else 2048)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    if (args.width is None) != (args.depth is None):
        p.error("--width and --depth go together")
    sizes = [(args.width, args.depth)] if args.width else []
    if not sizes:
        try:
            sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
        except ValueError:
            p.error(f"--sizes {args.sizes!r}: expected WIDTHxDEPTH[,WIDTHxDEPTH...]")
    args.size_list = sizes
    args.clips = {"off": (False,), "on": (True,), "both": (False, True)}[args.clip]
    for flag in ("contenders", "largest_contenders"):
        names = [c for c in getattr(args, flag).split(",") if c]
        bad = [c for c in names if c not in CONTENDERS]
        if bad:
            p.error(
                f"--{flag.replace('_', '-')}: unknown {bad}; choose from {', '.join(CONTENDERS)}"
            )
        setattr(args, flag, names)
    try:
        args.largest_start = {
            k: int(v) for k, v in (kv.split("=") for kv in args.largest_start.split(",") if kv)
        }
    except ValueError:
        p.error(f"--largest-start {args.largest_start!r}: expected NAME=DEPTH,...")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = environment(torch.device(args.device))
    threads_env = (
        "OMP_NUM_THREADS",
        "OMP_WAIT_POLICY",
        "BENCH_OFFLOAD_THREADS",
        "BENCH_OFFLOAD_HUGE_PAGES",
        "BENCH_OFFLOAD_BLOCKING_SYNC",
        "BENCH_OFFLOAD_SWITCH_INTERVAL",
    )
    env["offload_threads_env"] = {k: os.environ[k] for k in threads_env if k in os.environ}
    args.report = {
        "environment": env,
        "args": {k: v for k, v in vars(args).items() if k != "report"},
    }
    print(
        f"{env['date']}  {env['device_name']}  torch {env['torch']}  commit {env['commit']}  "
        f"{env['cpu_count']} CPUs; "
        + (
            f"batch {args.largest_batch} x {args.seq} tokens, {args.largest_steps} steps an attempt"
            if args.largest
            else f"batch {args.batch} x {args.seq} tokens, {args.warmup} warm-up + {args.steps} "
            "timed steps"
        ),
        flush=True,
    )
    runner = Runner(args)

    def terminated(signum: int, frame: Any) -> None:  # `timeout` ends this run: the worker too
        runner.kill_worker()
        write_json(args.out, args.report)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        run_all(args, runner)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return args.report


def run_all(args: argparse.Namespace, runner: Runner) -> None:
    """The largest-model search, or every size's contenders."""
    if args.largest:
        args.report["largest"] = run_largest(args, runner)
    else:
        args.report["sizes"] = []
        for width, depth in args.size_list:
            run_size(args, runner, width, depth)
    write_json(args.out, args.report)


if __name__ == "__main__":
    main()
