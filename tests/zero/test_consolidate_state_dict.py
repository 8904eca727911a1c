"""``consolidate_state_dict(to)``, torch ZeroRedundancyOptimizer's call, for ported scripts:
afterwards ``state_dict()`` on rank ``to`` alone returns the whole state (the collective's),
until the next step; then a one-rank ``state_dict()`` is the usual CollectiveCallError on every
rank, not a stale state and not a hang."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_cases
from torch import nn

import shardopt
from shardopt.zero import comm


def _stepped(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2)
    torch.manual_seed(rank)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _same(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for name, t in a["state"][i].items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(b["state"][i][name])), name


def consolidated_on_one_rank(rank, world):
    model, opt = _stepped(rank)
    expected = opt.state_dict()
    last = world - 1
    opt.consolidate_state_dict(to=last)
    if rank == last:
        _same(opt.state_dict(), expected)  # no collective: the others do not call it
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    os.environ[comm.ARRIVAL_TIMEOUT_ENV] = "3"
    try:
        if world == 1:
            opt.state_dict()
        elif rank == last:  # a step since: the kept dict is stale, the call is collective again
            with pytest.raises(comm.CollectiveCallError, match="state_dict"):
                opt.state_dict()
    finally:
        del os.environ[comm.ARRIVAL_TIMEOUT_ENV]


CASES = [consolidated_on_one_rank]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=180.0, pg_timeout=60.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_consolidate(results, case):
    assert results[case.__name__] is None, results[case.__name__]
