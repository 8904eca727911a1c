"""launch_scripts/bench/bench_muon.py on the CPU at toy sizes: its sets are gpt.py's params split as
shardopt.muon_param_groups splits them, a run's JSON, JSON lines and tables, the peers reported
whether or not they are installed, the time budget and a subprocess peer cut off at its limit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "launch_scripts"
sys.path[:0] = [str(SCRIPTS / "bench"), str(SCRIPTS / "train")]

import bench_muon  # noqa: E402
import bench_muon_sets  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import shardopt  # noqa: E402

#: each peer and the module whose absence makes it "not installed"
PEERS = {
    "emerging": "emerging_optimizers",
    "emerging_syrk": "emerging_optimizers",
    "heavyball_eager": "heavyball",
    "heavyball": "heavyball",
    "heavyball_default": "heavyball",
    "deepspeed": "deepspeed",
}


@pytest.mark.parametrize(("set_name", "preset"), [("gpt124m", "gpt2"), ("gpt1.3b", "1.4b")])
def test_gpt_sets_are_gpt_py_split_by_muon_param_groups(set_name, preset):
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(preset))
    specs = bench_muon_sets.set_specs(set_name, tiny=False, llama_layers=0)
    assert [(s.name, s.shape) for s in specs] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    groups = shardopt.muon_param_groups(model)
    muon_ids = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    names = dict(model.named_parameters())
    assert [s.name for s in specs if s.optimizer == "muon"] == [
        n for n, p in names.items() if id(p) in muon_ids
    ]


def test_llama_layer_shapes_and_flops():
    specs = bench_muon_sets.set_specs("llama8b", tiny=False, llama_layers=2)
    stacks = bench_muon_sets.matrix_stacks(specs)
    assert stacks == [(4, 4096, 4096), (4, 1024, 4096), (4, 14336, 4096), (2, 4096, 14336)]
    assert bench_muon_sets.describe(specs)["numel"] == 2 * 218_112_000
    # 20 n²m + 10 n³ per n x m matrix, n <= m, 5 steps: 30 n³ for a square one
    assert bench_muon_sets.ns_flops([(1, 4096, 4096)]) == 30 * 4096**3
    assert bench_muon_sets.ns_flops([(3, 6, 2)]) == 3 * (20 * 4 * 6 + 10 * 8)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_merged_orientations_trial_is_each_stack_orthogonalized():
    """The ``shardopt_batched_merged`` row times the same maps: each stack's result, in its own
    layout, whether it ran merged with the transposed stacks of its shape or alone (fp64)."""
    import bench_muon_ns

    from shardopt.algorithms import muon

    gen = torch.Generator().manual_seed(3)
    stacks = [
        torch.randn(s, generator=gen, dtype=torch.float64)
        for s in [(3, 48, 16), (2, 16, 48), (2, 16, 16), (1, 40, 16)]
    ]
    triples = [bench_muon_ns.COEFFICIENTS] * 5
    want = [muon.newton_schulz(x.clone(), triples, 1e-7) for x in stacks]
    seen = []

    def run_all(merged):
        seen.extend(tuple(m.shape) for m in merged)
        return [muon.newton_schulz(m, triples, 1e-7) for m in merged]

    got = bench_muon_ns._merged_orientations([x.clone() for x in stacks], run_all)()
    assert sorted(seen) == [(1, 16, 40), (2, 16, 16), (5, 16, 48)]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_cpu_tiny_run(tmp_path, capsys, one_thread):
    out, jsonl, md = tmp_path / "muon.json", tmp_path / "muon.jsonl", tmp_path / "muon.md"
    bench_muon.main(["--device", "cpu", "--tiny", "--out", str(out), "--jsonl", str(jsonl)]
                    + ["--md", str(md), "--budget-s", "600"])  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == rows
    assert result["environment"]["device"] == "cpu"
    (gemm,) = [r for r in rows if r["kind"] == "gemm"]
    assert gemm["what"] == "mm 256^3" and gemm["tflops"] > 0
    for set_name in bench_muon_sets.SETS:
        specs = bench_muon_sets.set_specs(set_name, tiny=True, llama_layers=4)
        ns = {r["what"]: r for r in rows if r["kind"] == "ns" and r["set"] == set_name}
        for what in ("gemm_same_shapes", "shardopt_batched", "torch_one_at_a_time"):
            assert ns[what]["ms"] > 0 and ns[what]["tflops"] > 0, ns[what]
            assert ns[what]["flops"] == bench_muon_sets.ns_flops(
                bench_muon_sets.matrix_stacks(specs)
            )
            assert ns[what]["of_gemm"] == pytest.approx(ns[what]["tflops"] / gemm["tflops"])
        assert 0 < ns["shardopt_batched"]["of_gemm_same_shapes"]
        step = {r["contender"]: r for r in rows if r["kind"] == "step" and r["set"] == set_name}
        assert list(step) == list(bench_muon.CONTENDERS)
        assert step["torch"]["vs_torch"] == 1.0
        for name in ("torch", "fused"):
            r = step[name]
            assert r["ms"] > 0 and r["iters"] >= 2 and r["moved"] > 0, r
            assert r["numel"] == bench_muon_sets.describe(specs)["numel"]
        assert step["fused"]["vs_torch"] == pytest.approx(step["fused"]["ms"] / step["torch"]["ms"])
        if bench_muon.gram_option() is None:
            assert "no Gram Newton-Schulz option" in step["fused_gram"]["error"]
        else:
            assert step["fused_gram"]["ms"] > 0
        for peer, module in PEERS.items():
            if importlib.util.find_spec(module) is None:
                assert "not installed" in step[peer]["error"], step[peer]
            else:  # measured, or its failure recorded: never missing
                assert "ms" in step[peer] or step[peer]["error"], step[peer]
    printed = capsys.readouterr().out
    table = md.read_text()
    for text in (printed, table):
        assert "| set | contender | version | ms | time / torch's | param change | note |" in text
        assert "| gpt124m | fused |" in text and "| llama8b | shardopt_batched |" in text
    assert any(line.startswith("gpt1.3b fused: ") for line in result["summary"])


def test_time_budget_skips(tmp_path, one_thread):
    out = tmp_path / "muon.json"
    bench_muon.main(["--device", "cpu", "--tiny", "--budget-s", "0", "--out", str(out)]
                    + ["--contenders", "torch,fused,deepspeed", "--sets", "gpt124m"])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    skipped = [r for r in rows if r["kind"] != "gemm"]
    assert [(r["kind"], r.get("contender")) for r in skipped] == [
        ("ns", None), ("step", "torch"), ("step", "fused"), ("step", "deepspeed")
    ]  # fmt: skip
    assert all(r["error"] == "skipped: time budget" for r in skipped)


def test_subprocess_peer_killed_at_its_limit():
    args = bench_muon.parse_args(["--device", "cpu", "--tiny", "--sets", "gpt124m,llama8b"])
    rows = bench_muon.run_worker("heavyball", args, seconds=0.05)
    assert [(r["set"], r["contender"]) for r in rows] == [
        ("gpt124m", "heavyball"), ("llama8b", "heavyball")
    ]  # fmt: skip
    assert all(r["error"].startswith("killed at the time limit") for r in rows)
