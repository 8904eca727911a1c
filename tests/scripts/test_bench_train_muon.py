"""bench_train.py's Muon modes at world 2 on gloo (bench_train_muon_modes.py): the benchmark
times what it says, so ``shardopt_muon`` (DistributedFusedMuon) must follow the losses of
``ddp_muon`` (DDP + torch.optim.Muon + fused AdamW on the same split, lr and weight decay)
step by step, within bf16 Newton-Schulz's rounding, while AdamW's run departs from both (the
comparison tells optimizers apart). The DeepSpeed mode needs deepspeed and its compiles (minutes
on a CPU): not run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "launch_scripts" / "bench" / "bench_train.py"
TINY = [
    "--device", "cpu", "--layers", "2", "--d-model", "64", "--vocab", "128", "--seq", "32",
    "--batch", "2", "--steps", "4", "--warmup", "1", "--lr", "0.02",
]  # fmt: skip


@pytest.fixture(scope="module")
def modes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_train") / "run.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(BENCH), *TINY, "--modes", "ddp_adamw,ddp_muon,shardopt_muon", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())["modes"]


def test_muon_modes_run_and_report(modes):
    for name in ("ddp_muon", "shardopt_muon"):
        assert "error" not in modes[name], modes[name]["error"]
        assert modes[name]["settings"]["adjust_lr_fn"] == "match_rms_adamw"
        assert modes[name]["step_ms"] > 0 and modes[name]["opt_ms"] > 0
    assert modes["shardopt_muon"]["settings"]["overlap_grad_sync"] is True


def test_shardopt_muon_follows_torch_muon(modes):
    torch_muon, ours = modes["ddp_muon"]["losses"], modes["shardopt_muon"]["losses"]
    adamw = modes["ddp_adamw"]["losses"]
    assert len(ours) == len(torch_muon) == len(adamw) == 5
    assert ours[0] == torch_muon[0] == adamw[0]  # the same model and data before any step
    for a, b in zip(ours[1:], torch_muon[1:]):
        assert abs(a - b) <= 1e-3 * abs(b), (ours, torch_muon)
    # the check can fail: another optimizer's losses are far away after a few steps
    assert abs(adamw[-1] - torch_muon[-1]) > 0.1 * abs(torch_muon[-1]), (adamw, torch_muon)
