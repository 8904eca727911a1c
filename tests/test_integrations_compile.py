"""torch.compile: a compiled model trained with DistributedFusedAdam equals the eager run (world
2, gloo); the single-process FusedAdam/FusedSGD kernels are torch.library custom ops, so Dynamo
traces ``opt.step()`` without breaking the graph at the kernel call."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_harness import run_cases

import shardopt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.a = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.b = nn.Linear(16, 11)

    def forward(self, idx):
        return self.b(self.ln(torch.relu(self.a(self.emb(idx)))))


def _train(compiled: bool, rank: int, backend: str):
    torch._dynamo.reset()
    model = Net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    fwd = torch.compile(model, backend=backend) if compiled else model
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        idx = torch.randint(0, 11, (4, 5), generator=g)
        for micro in range(2):
            logits = fwd(idx)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()) / 2
            if micro == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def compiled_equals_eager(rank, world):
    eager = _train(False, rank, "inductor")
    for backend in ("aot_eager",):  # inductor passes too (+30 s of compiling on 2 cores)
        got = _train(True, rank, backend)
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=backend)


def test_compiled_model_distributed_adam():
    err = run_cases([compiled_equals_eager], 2, timeout=400)["compiled_equals_eager"]
    assert err is None, err


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD"])
def test_fused_step_compiles_fullgraph(name):
    """``opt.step()`` compiles with fullgraph=True (no graph break at the kernel) and updates as
    the eager step does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m, m2 = nn.Linear(4, 3), nn.Linear(4, 3)
    m2.load_state_dict(m.state_dict())
    kw = dict(lr=0.1, momentum=0.9) if name == "FusedSGD" else dict(lr=0.1, weight_decay=0.1)
    opt = getattr(shardopt, name)(m.parameters(), **kw)
    ref = getattr(shardopt, name)(m2.parameters(), **kw)

    def step(o):
        o.step()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for it in range(3):
        x = torch.randn(2, 4)
        m(x).sum().backward()
        m2(x).sum().backward()
        if it == 0:  # explain runs the step, traced
            explained = torch._dynamo.explain(step)(opt)
            assert explained.graph_break_count == 0, explained.break_reasons
        else:
            compiled(opt)
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for a, b in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
