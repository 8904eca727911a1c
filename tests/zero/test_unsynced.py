"""Trainable params held by no DistributedFused* optimizer (Note: unsynced params): another
optimizer on them with no DDP would train a copy per rank; the first steps find params that
differ across ranks and raise on every rank, naming them; params synced by other means pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases
from torch import nn

import shardopt
from shardopt.zero.unsynced import UnsyncedParamsError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _split(model):
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, nn.Linear)]
    return weights, biases


def _train(model, opts, rank, steps=3, sync_weights=False):
    for step in range(steps):
        torch.manual_seed(100 * step + rank)  # each rank its own batch
        model(torch.randn(4, 8)).square().mean().backward()
        if sync_weights:
            for p in _split(model)[0]:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def another_optimizer_without_sync_raises_everywhere(rank, world):
    """torch.optim.SGD on the matrices, DistributedFusedAdam on the biases, no DDP: at world 1
    nothing to sync; above it, the first step raises on every rank naming the matrices."""
    model = _model()
    weights, biases = _split(model)
    opts = [torch.optim.SGD(weights, lr=0.1), shardopt.DistributedFusedAdam(biases, lr=0.1)]
    if world == 1:
        _train(model, opts, rank)
        return
    with pytest.raises(UnsyncedParamsError, match=r"2 trainable params .*Linear\.weight \(16, 8\)"):
        _train(model, opts[::-1], rank)  # the distributed optimizer steps first: its 2nd step
    model = _model()
    weights, biases = _split(model)
    opts = [torch.optim.SGD(weights, lr=0.1), shardopt.DistributedFusedAdam(biases, lr=0.1)]
    with pytest.raises(UnsyncedParamsError, match=r"differ across ranks"):
        _train(model, opts, rank, steps=1)  # SGD steps first: the values differ at step 1


def params_synced_by_other_means_pass(rank, world):
    """Grads of the matrices averaged by hand, or the matrices in a second distributed
    optimizer: no error, and the ranks keep equal params."""
    for second in (False, True):
        model = _model()
        weights, biases = _split(model)
        other = shardopt.DistributedFusedSGD if second else torch.optim.SGD
        opts = [other(weights, lr=0.1), shardopt.DistributedFusedAdam(biases, lr=0.1)]
        _train(model, opts, rank, sync_weights=not second)
        for p in model.parameters():
            every = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(every, p.detach().contiguous())
            assert all(torch.equal(e, every[0]) for e in every)


def params_nobody_steps_pass(rank, world):
    """Trainable matrices in no optimizer at all: their grads differ across ranks, but nothing
    steps them, so their values stay equal: no error."""
    model = _model()
    _train(model, [shardopt.DistributedFusedAdam(_split(model)[1], lr=0.1)], rank)


CASES = [
    another_optimizer_without_sync_raises_everywhere,
    params_synced_by_other_means_pass,
    params_nobody_steps_pass,
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=240.0, pg_timeout=60.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_unsynced(results, case):
    assert results[case.__name__] is None, results[case.__name__]
