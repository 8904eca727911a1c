"""A distributed optimizer in a plain ``python train.py`` (no launcher, no init_process_group):
a world of one is started for it, so CPU offload runs on one device as DeepSpeed users expect; a
launched process (``WORLD_SIZE`` > 1) that did not initialise still gets the error."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import copy, torch, torch.distributed as dist, shardopt
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
ref = copy.deepcopy(model)
opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, offload="cpu")
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
for step in range(4):
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1.3e-6, atol=1e-6)
print("world", dist.get_world_size(), "offloaded", opt.offload_plan.fraction)
"""


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(env_extra, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )


def test_offload_in_a_single_process_without_init():
    done = _run({})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world 1 offloaded 1.0" in done.stdout, done.stdout


def test_launched_process_without_init_is_told_to_initialise():
    done = _run({"WORLD_SIZE": "2", "RANK": "0"})
    assert done.returncode != 0
    assert "call torch.distributed.init_process_group() first" in done.stderr, done.stderr[-3000:]
