"""``algorithms.muon_streams``: a group's Newton-Schulz stacks on side CUDA streams at once where
they are small, one after another elsewhere, with the same bits either way."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_MARKS
from test_muon import _grads, _params, _run

from shardopt import FusedMuon
from shardopt.algorithms import muon, muon_streams

CUDA_MARK, CUDA_SKIP = CUDA_MARKS
TRIPLES = [muon.DEFAULT_NS_COEFFICIENTS] * 5
# the 124M GPT set's shapes, fewer layers: four stacks of one group
SHAPES = [(768, 2304)] * 3 + [(768, 768)] * 3 + [(768, 3072)] * 3 + [(3072, 768)] * 3


def test_cpu_runs_one_after_another_when_asked():
    """On the CPU each stack runs on the caller's thread as the caller reaches it: lazily, in
    order, the function's own results."""
    stacks = [
        torch.randn(2, 8, 16, dtype=torch.float64),
        torch.randn(3, 16, 8, dtype=torch.float64),
    ]
    calls = []

    def fn(x):
        calls.append(x.shape)
        return muon.newton_schulz(x.clone(), TRIPLES, 1e-7)

    assert not muon_streams.concurrent(stacks)
    results = muon_streams.orthogonalized(stacks, fn)
    assert calls == []
    first = next(results)
    assert calls == [stacks[0].shape]
    assert torch.equal(first, muon.newton_schulz(stacks[0].clone(), TRIPLES, 1e-7))
    assert torch.equal(next(results), muon.newton_schulz(stacks[1].clone(), TRIPLES, 1e-7))
    assert calls == [stacks[0].shape, stacks[1].shape]


@CUDA_MARK
@CUDA_SKIP
def test_cuda_side_streams_give_the_same_bits(monkeypatch):
    """Stacks that ``concurrent`` sends to side streams give exactly the results of one stack
    after another on the caller's stream."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(36, 768, 2304), (12, 768, 768), (12, 3072, 768)]
    base = [torch.randn(*s, generator=gen).to("cuda", torch.bfloat16) for s in shapes]
    assert muon_streams.concurrent(base)

    def ns(x):
        return muon.newton_schulz(x, TRIPLES, 1e-7)

    together = list(muon_streams.orthogonalized([b.clone() for b in base], ns))
    monkeypatch.setattr(muon_streams, "CONCURRENT_MAX_ELEMENTS", 0)
    assert not muon_streams.concurrent(base)
    alone = list(muon_streams.orthogonalized([b.clone() for b in base], ns))
    for x, y in zip(together, alone):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_fused_muon_steps_are_the_same_with_side_streams(monkeypatch, dtype):
    """FusedMuon's steps on the 124M-like group: identical params and momentum with the stacks on
    side streams and one after another (the caller's stream sees every result in time)."""
    grads = [_grads(SHAPES, dtype, "cuda", scale=1.0 + i) for i in range(3)]

    def run(limit):
        monkeypatch.setattr(muon_streams, "CONCURRENT_MAX_ELEMENTS", limit)
        torch.manual_seed(1)
        params = _params(SHAPES, dtype, "cuda")
        opt = FusedMuon(params, lr=0.02)
        for g in grads:
            _run(opt, params, g)
        torch.cuda.synchronize()
        return params, [opt.state[p]["momentum_buffer"] for p in params]

    together, alone = run(1 << 27), run(0)
    for x, y in zip(together[0] + together[1], alone[0] + alone[1]):
        assert torch.equal(x, y)
