"""launch_scripts/bench/bench_offload.py and bench_cpu_adam.py on the CPU with tiny sizes: the
records, the tables, the skips of GPU-only peers, a worker subprocess and its failure path, and the
largest-model search's walk (against a fake attempt runner); the host probes of
launch_scripts/probe/."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "launch_scripts"
sys.path[:0] = [str(SCRIPTS / "bench"), str(SCRIPTS / "probe")]

import bench_cpu_adam  # noqa: E402
import bench_offload  # noqa: E402
from bench_offload_search import search  # noqa: E402
from bench_offload_worker import Spec  # noqa: E402

TINY = ["--device", "cpu", "--width", "64", "--depth", "2", "--seq", "16", "--vocab", "64"]
TINY += ["--batch", "2", "--warmup", "1", "--steps", "2"]


def test_cpu_run_in_process(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench_offload.main([*TINY, "--in-process", "--out", str(out)])
    assert json.loads(out.read_text())["sizes"][0]["params"] == report["sizes"][0]["params"]
    size = report["sizes"][0]
    records = size["contenders"]
    assert list(records) == bench_offload.DEFAULT_CONTENDERS
    for name in ("deepspeed_offload", "fsdp2_offload", "torchao_offload"):
        assert records[name]["skipped"] == f"{name} needs a CUDA device"
    for name in ("no_offload", "torch_fused"):
        phases = records[name]["phases"]
        assert [p["clip"] for p in phases] == [False, True]
        for p in phases:
            assert p["step_ms"] > 0 and len(p["times_ms"]) == 2
            assert all(math.isfinite(x) for x in p["losses"]) and len(p["losses"]) == 3
        assert records[name]["host_bytes_per_param"] is not None
    # the same model (seed), dtype and tokens: the first loss, before any update, is the same
    first = records["no_offload"]["phases"][0]["losses"][0]
    assert records["fwd_bwd"]["phases"][0]["losses"][0] == first
    for name in ("offload", "offload_auto"):  # until this shardopt has CPU offload
        assert "phases" in records[name] or "CPUOffload" in records[name]["skipped"]
    assert records["cpu_update"]["phases"][0]["step_ms"] > 0
    target = size["target"]
    assert target["floor_ms"] == max(target["fwd_bwd_ms"], target["cpu_update_ms"])
    printed = capsys.readouterr().out
    assert "| contender | clip | step ms |" in printed
    assert "deepspeed_offload: skipped: deepspeed_offload needs a CUDA device" in printed
    # one table row per contender and clip setting that ran
    rows = [line for line in printed.splitlines() if line.startswith("| no_offload |")]
    assert len(rows) == 2


def test_worker_subprocess(tmp_path):
    args = bench_offload.parse_args([*TINY, "--log-dir", str(tmp_path)])
    runner = bench_offload.Runner(args)
    spec = bench_offload.worker_specs("no_offload", args, 64, 2)[0]
    spec.clips = (True,)
    record = runner(spec)
    assert record["contender"] == "no_offload" and record["phases"][0]["clip"] is True
    assert record["phases"][0]["step_ms"] > 0
    assert record["host_peak_rss_gib"] >= record["host_rss_gib"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["01_no_offload_64x2_c.log"]


def test_worker_failure_is_a_record(tmp_path):
    args = bench_offload.parse_args([*TINY, "--log-dir", str(tmp_path)])
    bad = Spec(contender="no_such_peer", device="cpu", width=64, depth=2, vocab=64, seq=16)
    record = bench_offload.Runner(args)(bad)
    assert "unknown contender 'no_such_peer'" in record["error"]
    log = (tmp_path / "01_no_such_peer_64x2_n.log").read_text()
    assert "Traceback" in log and "BENCH_RESULT" in log


def test_worker_timeout_ends_its_process_group(monkeypatch):
    monkeypatch.setattr(bench_offload, "MIN_CONTENDER_S", 0.1)
    runner = bench_offload.Runner(bench_offload.parse_args(TINY))
    start = time.monotonic()
    record = runner(Spec(contender="no_offload", device="cpu", width=64, depth=2), timeout_s=1.0)
    assert record["error"] == "timed out after 1 s" and record["params"] > 0
    assert time.monotonic() - start < 10 and runner.worker is None


def test_budget_spent_skips():
    args = bench_offload.parse_args([*TINY, "--budget-s", "0"])
    record = bench_offload.Runner(args)(
        Spec(contender="no_offload", device="cpu", width=64, depth=2)
    )
    assert record["skipped"] == "time budget spent"


def _fake_runner(largest_ok: int, calls: list[int]):
    def run(spec: Spec, timeout_s: float) -> dict:
        calls.append(spec.depth)
        assert timeout_s > 0
        if spec.depth <= largest_ok:
            return {"params": spec.depth * 1000, "phases": [{"clip": True, "step_ms": 1.0}]}
        return {"params": spec.depth * 1000, "error": "killed by signal 9"}

    return run


@pytest.mark.parametrize(
    "start, largest_ok, expected_calls",
    [
        (10, 37, [10, 18, 26, 34, 42, 38, 36, 37]),  # up by 8, then bisect 34..42
        (50, 37, [50, 42, 34, 38, 36, 37]),  # the first fails: down by 8, then bisect 34..42
        (10, 200, [10, 18, 26, 34, 42]),  # the depth limit ends it
    ],
)
def test_search_walks_and_bisects(start, largest_ok, expected_calls):
    calls: list[int] = []
    base = Spec(contender="offload", device="cpu", width=64, depth=1)
    result = search(
        base,
        _fake_runner(largest_ok, calls),
        start=start,
        step=8,
        max_depth=45,
        resolution=1,
        deadline=time.monotonic() + 600,
        attempt_timeout_s=100,
    )
    assert calls == expected_calls
    assert result["largest"]["depth"] == min(largest_ok, 42)
    if largest_ok < 42:
        assert result["first_failure"]["depth"] == largest_ok + 1
        assert result["first_failure"]["why"] == "killed by signal 9"
        assert result["stopped"] is None
    else:
        assert result["first_failure"] is None
        assert result["stopped"] == "trained up to the depth limit (45 blocks)"


def test_search_stops_on_budget_and_on_skip():
    base = Spec(contender="offload", device="cpu", width=64, depth=1)
    kwargs = dict(start=8, step=8, max_depth=64, resolution=1, attempt_timeout_s=100)
    spent = search(base, _fake_runner(30, []), deadline=time.monotonic(), **kwargs)
    assert spent["attempts"] == [] and spent["stopped"].startswith("time budget spent")
    calls: list[int] = []

    def skipping(spec: Spec, timeout_s: float) -> dict:
        calls.append(spec.depth)
        return {"params": 1, "skipped": "this shardopt has no CPU offload"}

    skipped = search(base, skipping, deadline=time.monotonic() + 600, **kwargs)
    assert calls == [8] and skipped["stopped"] == "skipped"
    assert skipped["first_failure"]["why"] == "this shardopt has no CPU offload"


def test_cpu_adam_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # its import fails: a skip, not an error
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    kernels = "shardopt_fp32,shardopt_bf16_grads_bf16_out,deepspeed_cpu_adam,torch_fused"
    out = tmp_path / "cpu_adam.json"
    report = bench_cpu_adam.main(
        [
            "--tensors",
            "3",
            "--numel",
            "5000",
            "--threads",
            "1",
            "--warmup",
            "1",
            "--steps",
            "3",
            "--kernels",
            kernels,
            "--out",
            str(out),
        ]  # fmt: skip
    )
    results = report["kernels"]
    assert results["deepspeed_cpu_adam"]["skipped"].startswith("deepspeed does not import")
    for name in ("shardopt_fp32", "shardopt_bf16_grads_bf16_out", "torch_fused"):
        r = results[name]
        assert len(r["times_ms"]) == 3 and r["median_ms"] == sorted(r["times_ms"])[1]
        assert r["gbs"] == pytest.approx(15000 * r["bytes_per_param"] / r["median_ms"] / 1e6)
    assert json.loads(out.read_text())["params"] == 15000
    printed = capsys.readouterr().out
    assert "| kernel | median ms |" in printed
    assert any(line.startswith("torch_fused / shardopt_fp32:") for line in report["summary"])


def test_flags():
    args = bench_offload.parse_args(["--device", "cpu", "--clip", "on", "--sizes", "64x2,96x3"])
    assert (args.seq, args.vocab, args.batch) == (64, 512, 4)  # a CPU run checks, small
    assert args.size_list == [(64, 2), (96, 3)] and args.clips == (True,)
    assert args.largest_start == {"offload": 44, "offload_compact": 100, "deepspeed_offload": 24}
    for bad in (["--contenders", "nope"], ["--width", "64"], ["--sizes", "64by2"]):
        with pytest.raises(SystemExit):
            bench_offload.parse_args(["--device", "cpu", *bad])


def test_host_memory_lines_count_what_the_optimizer_adds():
    """The report gives each offload contender's host B/param above the process's baseline and,
    when the no-offload run is there, above that run's own (what every training process adds)."""
    from bench_offload_report import full_offload_target

    records = {
        "no_offload": {"host_bytes_per_param": 0.25, "phases": []},
        "offload": {"host_bytes_per_param": 12.75, "phases": []},
    }
    out = full_offload_target(records)
    assert out["offload_host_bytes_per_param"] == 12.75
    assert out["offload_host_bytes_per_param_over_no_offload"] == 12.5
    line = "offload: host memory 12.75 B/param above the process's baseline (target <= 12.5)"
    assert line + "; 12.50 above no_offload's (0.25)" in out["lines"]
    out = full_offload_target({"offload": records["offload"]})  # without the no-offload run
    assert line in out["lines"] and "offload_host_bytes_per_param_over_no_offload" not in out


def test_host_bandwidth_probe_on_cpu(tmp_path):
    """probe_host_bandwidth.py at a tiny size: the CPU rows first (the DMA rows follow on a GPU),
    each GB/s the bytes it counts over its time."""
    import probe_host_bandwidth

    out = tmp_path / "bw.json"
    argv = ["--buckets", "2", "--numel", "65536", "--threads", "1", "--rounds", "2"]
    rows = probe_host_bandwidth.main([*argv, "--out", str(out)])
    names = [r[0] for r in rows]
    cpu_rows = ["copy", "read", "in place", "adam one call", "adam per bucket"]
    cpu_rows.append("adam per bucket, thread")
    assert names[:6] == cpu_rows
    per_element = dict(zip(cpu_rows, [8, 4, 8, 28, 28, 28]))
    for name, ms, gbs in rows[:6]:
        assert ms > 0
        assert gbs == pytest.approx(per_element[name] * 2 * 65536 / (ms / 1e3) / 1e9)
    saved = json.loads(out.read_text())
    assert saved["buckets"] == 2 and [r["name"] for r in saved["rows"]] == names


def test_host_pages_probe_cases_agree():
    """probe_host_pages.py: every case (pages, first touch, the bench's chunks or the pipeline's
    flat state and slots) runs the same update: after three steps each case's masters are the
    first case's, bit for bit, and have moved; an unknown shape is refused."""
    import argparse

    import probe_host_pages
    import torch

    args = argparse.Namespace(params=5000, chunk=1536, threads=1)
    cases = ["4k-par-chunks", "4k-ser-chunks", "4k-par-flat", "4k-ser-flat"]
    cases += ["huge-ser-flat", "aligned-par-chunks"]
    results = {}
    for case in cases:
        step, masters = probe_host_pages.build(args, case)
        for s in range(1, 4):
            step(s)
        results[case] = torch.cat(masters)
    first = results[cases[0]]
    assert first.numel() == 5000 and not torch.equal(first, torch.full_like(first, 0.01))
    for case in cases[1:]:
        assert torch.equal(results[case], first), case
    with pytest.raises(ValueError, match="unknown shape"):
        probe_host_pages.build(args, "4k-par-rings")
