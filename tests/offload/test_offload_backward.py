"""CPU offload with updates during backward (``CPUOffload(overlap_backward=True)``): what may run
between backward and ``step()`` (see Note: updates during backward in
shardopt/zero/offload/backward.py), on gloo at worlds 1-3, against the same run without offload:

- state reads there (``state_dict()``, ``sharded_state_dict()``, ``shardopt.checkpoint.save``)
  raise on every rank and change nothing: the run then equals the one without offload bit for bit;
- loads there (``load_state_dict()``, ``load_sharded_state_dict()``, ``shardopt.checkpoint.load``)
  raise on every rank and change nothing too; ``zero_grad()`` then a checkpoint with the model
  rolls back, bit for bit as without offload;
- after a misuse error in ``step()`` (a clip, a second synchronised backward) the optimizer is
  usable: the ranks' params agree, the step count has not moved, ``zero_grad()`` and the next
  steps work, and ``shardopt.checkpoint.load`` resumes the uninterrupted run bit for bit;
- ``zero_grad()`` there on every rank warns and leaves the ranks' params equal; on one rank only,
  every rank raises ``LockstepError``;
- ``overlap_backward`` differing between ranks: ``ValueError`` on every rank at construction.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_plan import plan_fixture, plan_params
from test_offload import _same
from torch import nn

import shardopt
from shardopt import checkpoint
from shardopt.zero.lockstep import LockstepError

ROOT = "SHARDOPT_TEST_OFFLOAD_BACKWARD_ROOT"
BETWEEN = "between backward and step"


class Net(nn.Module):
    """Sizes off every alignment; params straddle the buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 300)
        self.b = nn.Linear(300, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _opt(model, early: bool = True):
    """Adam with every bucket offloaded and updated during backward (``early``), or without
    offload (the reference)."""
    return shardopt.DistributedFusedAdam(
        model.parameters(),
        lr=0.02,
        weight_decay=0.05,
        bucket_cap_mb=1000 * 4 / 2**20,  # several buckets
        offload=shardopt.CPUOffload(overlap_backward=True) if early else None,
    )


def _backward(model, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(6, 7, generator=gen)).pow(2).mean().backward()


def _steps(model, opt, rank: int, steps) -> None:
    for step in steps:
        _backward(model, rank, step)
        opt.step()
        opt.zero_grad()


def _result(model, opt) -> tuple:
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _ranks_agree(model, world: int) -> None:
    """Every rank holds the same params (no rank kept an update the others lack)."""
    for name, p in model.named_parameters():
        everyone = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(everyone, p.detach().contiguous())
        for r, other in enumerate(everyone):
            assert torch.equal(other, everyone[0]), f"{name}: rank {r} differs from rank 0"


def _steps_of(opt) -> list[int]:
    return [int(g["step"].item()) for g in opt.param_groups]


def reads_between_backward_and_step_raise(rank, world):
    """state_dict(), sharded_state_dict() and checkpoint.save between backward and step() raise
    on every rank (the state holds part of a step not taken yet) and change nothing."""
    root = Path(os.environ[ROOT])
    runs = []
    for early in (False, True):
        model = _model()
        opt = _opt(model, early)
        _steps(model, opt, rank, range(2))
        _backward(model, rank, 2)
        if early:
            assert opt._offload_pipeline.early.done  # buckets were handed over in backward
            for read in (
                opt.state_dict,
                opt.sharded_state_dict,
                lambda o=opt: checkpoint.save(root / f"w{world}-between", o),
            ):
                with pytest.raises(RuntimeError, match=BETWEEN):
                    read()
            assert not (root / f"w{world}-between" / "metadata.json").exists()
        opt.step()
        opt.zero_grad()
        _steps(model, opt, rank, range(3, 4))
        runs.append(_result(model, opt))
        checkpoint.save(root / f"w{world}-after-{early}", opt)  # after step(): saved
    _same(runs[0], runs[1], "overlap_backward against no offload")


def loads_between_backward_and_step_raise(rank, world):
    """load_state_dict(), load_sharded_state_dict() and checkpoint.load between backward and
    step() raise on every rank (the early buckets' params cannot be put back) and change
    nothing; zero_grad() then a checkpoint with the model rolls back as without offload."""
    root = Path(os.environ[ROOT])
    runs = []
    for early in (False, True):
        model = _model()
        opt = _opt(model, early)
        _steps(model, opt, rank, range(2))
        path = root / f"w{world}-load-{early}"
        checkpoint.save(path, opt, model)
        saved, sharded = opt.state_dict(), opt.sharded_state_dict()
        _steps(model, opt, rank, range(2, 4))
        _backward(model, rank, 4)
        if early:
            for how in ("load_state_dict", "load_sharded_state_dict", "checkpoint.load"):
                with pytest.raises(RuntimeError, match=BETWEEN):
                    if how == "load_state_dict":
                        opt.load_state_dict(saved)
                    elif how == "load_sharded_state_dict":
                        opt.load_sharded_state_dict(sharded)
                    else:
                        checkpoint.load(path, opt, model)
        opt.step()
        opt.zero_grad()
        runs.append(_result(model, opt))
        _backward(model, rank, 5)  # a loss spike: roll back to the checkpoint
        if early:
            with pytest.warns(UserWarning, match="updated during backward"):
                opt.zero_grad()
        else:
            opt.zero_grad()
        checkpoint.load(path, opt, model)
        _steps(model, opt, rank, range(6, 8))
        runs.append(_result(model, opt))
    _same(runs[:2], runs[2:], "overlap_backward against no offload")


def misuse_in_step_leaves_a_usable_optimizer(rank, world):
    """A clip (or a second synchronised backward) after buckets were updated during backward
    raises in step() on every rank; then the ranks' params agree, the step count has not moved,
    zero_grad() and the next steps work, and a checkpoint resumes the run without offload."""
    root = Path(os.environ[ROOT])
    ref = _model()
    ref_opt = _opt(ref, early=False)
    _steps(ref, ref_opt, rank, range(2))
    path = root / f"w{world}-misuse"
    checkpoint.save(path, ref_opt)
    _steps(ref, ref_opt, rank, range(2, 4))
    expected = _result(ref, ref_opt)
    for misuse in ("clip", "second_backward"):
        model = _model()
        opt = _opt(model)
        _steps(model, opt, rank, range(2))
        _backward(model, rank, 2)
        if misuse == "clip":
            opt.clip_grad_norm(0.5)
        else:
            _backward(model, rank, 20)
        with pytest.raises(RuntimeError, match="overlap_backward=False"):
            opt.step()
        _ranks_agree(model, world)
        assert _steps_of(opt) == [2], misuse
        opt.zero_grad()  # the loop skips the batch: no error of a misuse not committed
        _steps(model, opt, rank, range(3, 5))
        _ranks_agree(model, world)
        assert _steps_of(opt) == [4], misuse
        checkpoint.load(path, opt)  # the documented recovery
        _steps(model, opt, rank, range(2, 4))
        _same(expected, _result(model, opt), f"{misuse}: resumed against no offload")


def zero_grad_between_backward_and_step_warns(rank, world):
    """Every rank drops a batch after backward: a warning on every rank that the buckets updated
    during backward keep it; the ranks' params agree and training goes on."""
    model = _model()
    opt = _opt(model)
    _steps(model, opt, rank, range(2))
    _backward(model, rank, 2)
    with pytest.warns(UserWarning, match="updated during backward"):
        opt.zero_grad()
    _ranks_agree(model, world)
    assert _steps_of(opt) == [2]
    _steps(model, opt, rank, range(3, 5))
    _ranks_agree(model, world)
    assert _steps_of(opt) == [4]


def zero_grad_on_one_rank_raises_everywhere(rank, world):
    """The last rank drops its grads after backward while the others step: LockstepError on
    every rank (not a lone error there and a closed connection on the others)."""
    if world == 1:
        return
    model = _model()
    opt = _opt(model)
    _steps(model, opt, rank, range(1))
    _backward(model, rank, 1)
    with pytest.raises(LockstepError, match="zero_grad"):
        if rank == world - 1:
            opt.zero_grad()
        else:
            opt.step()


def overlap_backward_differs_between_ranks(rank, world):
    """overlap_backward on some ranks only: ValueError on every rank, naming it."""
    if world == 1:
        return
    with pytest.raises(ValueError, match="overlap_backward"):
        shardopt.DistributedFusedAdam(
            _model().parameters(), offload=shardopt.CPUOffload(overlap_backward=rank == 0)
        )


CASES = [
    reads_between_backward_and_step_raise,
    loads_between_backward_and_step_raise,
    misuse_in_step_leaves_a_usable_optimizer,
    zero_grad_between_backward_and_step_warns,
    zero_grad_on_one_rank_raises_everywhere,
    overlap_backward_differs_between_ranks,
]
PLAN = [(1, CASES), (2, CASES), (3, CASES)]

results = plan_fixture(PLAN, ROOT, timeout=600, pg_timeout=30.0, report_hangs=True)


@plan_params(PLAN)
def test_offload_backward(results, world, case):
    results.check(world, case)
