"""Trainable params held by no DistributedFused* optimizer (Note: unsynced params in
shardopt/zero/unsynced.py), on gloo at worlds 1-3 and HSDP at world 4.

- Another optimizer on them with no sync (torch.optim.SGD on the matrices beside
  DistributedFusedAdam on the biases, no DDP): the first or second step raises
  ``UnsyncedParamsError`` on every rank, naming the params and the fixes, and nothing changed
  (params and the optimizer's state are those before that step); at world 1 nothing to compare.
- Params synced by other means pass and train as the distributed optimizer would: grads
  averaged by hand, DDP on the submodule of those params, a second distributed optimizer (the
  three runs agree, and every rank holds the same params); params nobody steps pass; exempted
  params pass.
- Modules that run on some ranks only (a branch taken on rank 0): no deadlock, no mis-paired
  params; when such a branch's params are stepped on rank 0 alone, every rank raises naming them.
- A rank out of lockstep at a checked step meets the lockstep check (``LockstepError`` on every
  rank), never this comparison.
- Bounded: one ``all_gather_object`` at each of the first two steps, none after (the hook is
  gone); none under ``capturable``, none at world 1.
- HSDP: one rank of four differing is seen by every rank, through both groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases
from torch import nn

import shardopt
from shardopt.zero import comm, unsynced
from shardopt.zero.lockstep import LockstepError
from shardopt.zero.unsynced import UnsyncedParamsError

TOL = dict(rtol=1e-6, atol=1e-7)


class Net(nn.Module):
    """A body and a head; a side branch used only where ``side`` is asked for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if side:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def _weights(model: Net) -> list[torch.Tensor]:
    return [model.body.weight, model.head.weight]


def _rest(model: Net) -> list[torch.Tensor]:
    held = {id(p) for p in _weights(model)}
    return [p for p in model.parameters() if id(p) not in held]


def _backward(model, step: int, rank: int, side: bool = False) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
    model(torch.randn(4, 8, generator=gen), side=side).square().mean().backward()


def _average_grads(params) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def _train(model, opts, rank, steps, *, sync=(), side_on=None):
    """``steps`` iterations; ``sync``: params whose grads are averaged by hand; ``side_on``: the
    ranks that run the side branch."""
    for step in steps:
        _backward(model, step, rank, side=side_on is not None and rank in side_on)
        _average_grads(sync)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def _snapshot(model, opt) -> tuple:
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _assert_unchanged(model, opt, snap, what) -> None:
    params, state = snap
    for (name, p), q in zip(model.named_parameters(), params):
        assert torch.equal(p.detach(), q), f"{what}: {name} changed"
    now = opt.state_dict()
    for pid, entry in state["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(now["state"][pid][k]), torch.as_tensor(v)), (
                f"{what}: state {pid}.{k} changed"
            )


def _ranks_agree(model, world: int) -> None:
    for name, p in model.named_parameters():
        every = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(every, p.detach().contiguous())
        assert all(torch.equal(e, every[0]) for e in every), f"{name} differs across ranks"


def another_optimizer_without_sync_raises_everywhere(rank, world):
    """SGD on the matrices, DistributedFusedAdam on the rest, no sync: DistributedFusedAdam
    stepping first meets the drift at its second step, after SGD at its first; every rank
    raises, naming both matrices and the fixes, and the step changed nothing."""
    for dist_first in (True, False):
        model = Net()
        adam = shardopt.DistributedFusedAdam(_rest(model), lr=0.1)
        sgd = torch.optim.SGD(_weights(model), lr=0.1)
        if world == 1:
            assert adam._unsynced._hook is None  # nothing to compare with
        raising = 1 if dist_first else 0
        snap = None
        try:
            for step in range(3):
                _backward(model, step, rank)
                if not dist_first:
                    sgd.step()
                if step == raising:
                    snap = _snapshot(model, adam)
                adam.step()
                if dist_first:
                    sgd.step()
                adam.zero_grad()
                sgd.zero_grad()
        except UnsyncedParamsError as e:
            assert world > 1, e
            message = str(e)
        else:
            assert world == 1, "no UnsyncedParamsError"
            continue
        assert "2 trainable params that no DistributedFused* optimizer holds differ" in message
        for name in ("body.weight (16, 8)", "head.weight (4, 16)"):
            assert name in message, message
        assert "bias" not in message and "side" not in message, message
        for fix in ("DistributedFused* optimizer", "DDP", "all_reduce(p.grad", "exempt"):
            assert fix in message, message
        _assert_unchanged(model, adam, snap, f"dist_first={dist_first}")


def params_synced_by_other_means_pass(rank, world):
    """The head and the body's matrix held by another optimizer, synced by other means: their
    grads averaged by hand, the head in DDP (the body's matrix by hand), or all of them in a
    second distributed optimizer: no error, every rank holds the same params, and the three
    runs agree (SGD on averaged grads is what DistributedFusedSGD computes)."""
    runs = []
    for how in ("by_hand", "ddp", "second"):
        model = Net()
        if how == "ddp":
            model.head = nn.parallel.DistributedDataParallel(model.head)
        others = [*model.head.parameters(), model.body.weight]
        sync = {"by_hand": others, "ddp": [model.body.weight], "second": []}[how]
        held = [p for p in model.parameters() if all(p is not q for q in others)]
        if how == "second":
            first = shardopt.DistributedFusedSGD(others, lr=0.1)
        else:
            first = torch.optim.SGD(others, lr=0.1)
        adam = shardopt.DistributedFusedAdam(held, lr=0.1)
        _train(model, [first, adam], rank, range(4), sync=sync)
        _ranks_agree(model, world)
        runs.append({n.replace("module.", ""): p.detach() for n, p in model.named_parameters()})
    for other in runs[1:]:
        for name, p in runs[0].items():
            torch.testing.assert_close(other[name], p, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(runs[0]["body.weight"], Net().body.weight.detach())  # it trained


def params_nobody_steps_or_exempted_pass(rank, world):
    """Trainable matrices in no optimizer: their grads differ across ranks, their values do
    not: no error. Matrices passed to ``unsynced.exempt`` and stepped without sync: no error,
    and they do differ (above one rank) while the rest agrees."""
    model = Net()
    _train(model, [shardopt.DistributedFusedAdam(_rest(model), lr=0.1)], rank, range(3))
    _ranks_agree(model, world)
    model = Net()
    unsynced.exempt(_weights(model))
    opts = [torch.optim.SGD(_weights(model), lr=0.1), shardopt.DistributedFusedAdam(_rest(model))]
    _train(model, opts, rank, range(3))
    every = [torch.empty_like(model.body.weight) for _ in range(world)]
    dist.all_gather(every, model.body.weight.detach())
    assert world == 1 or not torch.equal(every[0], every[-1])  # rank-local, as exempted
    for p in _rest(model):
        copies = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(copies, p.detach())
        assert all(torch.equal(c, copies[0]) for c in copies)


def module_on_some_ranks_only(rank, world):
    """The side branch runs on rank 0 only (its params held by DistributedFusedAdam, the
    matrices synced by hand): every rank compares the same keys, no deadlock, no error. With the
    side branch's params given to SGD instead (only rank 0 has grads for them, so only rank 0
    steps them), every rank raises naming exactly them."""
    model = Net()
    sgd = torch.optim.SGD(_weights(model), lr=0.1)
    adam = shardopt.DistributedFusedAdam(_rest(model), lr=0.1)
    _train(model, [sgd, adam], rank, range(3), sync=_weights(model), side_on={0})
    _ranks_agree(model, world)

    model = Net()
    side = list(model.side.parameters())
    ids = {id(p) for p in side}
    sgd = torch.optim.SGD(side, lr=0.1)
    adam = shardopt.DistributedFusedAdam([p for p in model.parameters() if id(p) not in ids])

    def run():
        _train(model, [sgd, adam], rank, range(3), side_on={0})

    if world == 1:
        run()
        return
    with pytest.raises(UnsyncedParamsError) as info:
        run()
    message = str(info.value)
    assert "2 trainable params" in message and "side.weight (16, 16)" in message, message
    assert "side.bias (16,)" in message and "body" not in message, message


def out_of_lockstep_meets_the_lockstep_check(rank, world):
    """At a checked step (the first, the second) the last rank skips its step() with unsynced
    params around: every rank raises LockstepError (the lockstep check runs first), not the
    unsynced comparison, and nothing hangs."""
    for deviant_step in (0, 1):
        model = Net()
        sgd = torch.optim.SGD(_weights(model), lr=0.1)
        adam = shardopt.DistributedFusedAdam(_rest(model), lr=0.1)

        def loop(model=model, sgd=sgd, adam=adam, deviant_step=deviant_step):
            for step in range(3):
                _backward(model, step, rank)
                _average_grads(_weights(model))
                if step == deviant_step and rank == world - 1:
                    continue
                adam.step()
                sgd.step()
                adam.zero_grad()
                sgd.zero_grad()

        if world == 1:
            loop()
            continue
        with pytest.raises(LockstepError, match="left lockstep"):
            loop()


def _counting(run) -> list[int]:
    """The all_gather_object calls of the engine's comm module in each of ``run``'s steps."""
    calls, per_step = [0], []
    original = comm.all_gather_object

    def counting(obj, group):
        calls[0] += 1
        return original(obj, group)

    comm.all_gather_object = counting
    try:
        run(lambda: (per_step.append(calls[0]), calls.__setitem__(0, 0)))
    finally:
        comm.all_gather_object = original
    return per_step


def bounded_cost(rank, world):
    """One all_gather_object at each of the first two steps (also with nothing to compare),
    none after, and the forward hook is removed; none at all under ``capturable``."""
    model = Net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.1)

    def run(tick, model=model, opt=opt):
        for step in range(4):
            _backward(model, step, rank)
            opt.step()
            opt.zero_grad()
            tick()

    assert _counting(run) == ([1, 1, 0, 0] if world > 1 else [0, 0, 0, 0])
    assert opt._unsynced._hook is None
    model = Net()  # capturable: a captured step has no host sync; the drift is not looked for
    opt = shardopt.DistributedFusedAdam(
        _rest(model), lr=0.1, capturable=True, skip_unused_params=False
    )
    sgd = torch.optim.SGD(_weights(model), lr=0.1)

    def run_capturable(tick, model=model, opts=(sgd, opt)):
        for step in range(3):
            _train(model, opts, rank, [step])
            tick()

    assert _counting(run_capturable) == [0, 0, 0] and opt._unsynced._hook is None


def hsdp_one_rank_differs(rank, world):
    """World 4, shard groups [0 1] [2 3], replica groups [0 2] [1 3]: the matrices are synced by
    hand over every rank, but rank 3 started from other values. Rank 0 shares neither group's
    comparison with rank 3 alone, yet every rank raises, naming the matrices."""
    assert world == 4
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = Net()
    if rank == 3:
        with torch.no_grad():
            model.head.weight.add_(1e-3)
    sgd = torch.optim.SGD(_weights(model), lr=0.1)
    adam = shardopt.DistributedFusedAdam(
        _rest(model),
        lr=0.1,
        process_group=shard[rank // 2],
        redundant_process_group=replica[rank % 2],
    )
    with pytest.raises(UnsyncedParamsError) as info:
        _train(model, [adam, sgd], rank, range(2), sync=_weights(model))
    message = str(info.value)
    assert "1 trainable param that" in message and "head.weight (4, 16)" in message, message


CASES = [
    another_optimizer_without_sync_raises_everywhere,
    params_synced_by_other_means_pass,
    params_nobody_steps_or_exempted_pass,
    module_on_some_ranks_only,
    out_of_lockstep_meets_the_lockstep_check,
    bounded_cost,
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=300.0, pg_timeout=30.0, report_hangs=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_unsynced(results, case):
    assert results[case.__name__] is None, results[case.__name__]


def test_unsynced_hsdp_world4():
    err = run_cases([hsdp_one_rank_differs], 4, timeout=300.0, pg_timeout=30.0)
    assert err["hsdp_one_rank_differs"] is None, err["hsdp_one_rank_differs"]
