"""Param sync (shardopt/zero/param_sync.py): what a read of the params after ``step()`` sees, on
gloo at worlds 1-3, compared bit for bit with the same run without the feature.

- ``overlap_param_sync=True``: a forward that reads a param of another module (a tied head:
  ``F.linear(h, self.head.weight)``) or calls ``child.forward()`` directly, and reads through
  ``module.parameters()`` / ``p.data`` between ``step()`` and the next forward, see the updated
  values, with and without CPU offload. The all-gathers are replaced by ones whose data land only
  when waited for (``_late_all_gathers``), so a read that does not wait loses the race every time.
- An optimizer dropped after its last ``step()`` without ``close()`` leaves the params updated
  (with offload its last all-gathers are still with the worker then; a separate param-sync
  buffer needs the copy into the params).
- Writes through ``p.data`` (``mul_``, ``clamp_``, ``copy_``) between steps hold with offload as
  without: the params are the truth (Note: the params are the truth, engine.py).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
import torch.nn.functional as F
from dist_plan import plan_fixture, plan_params
from torch import nn

import shardopt
from shardopt.zero import comm

ROOT = "SHARDOPT_TEST_PARAM_SYNC_ROOT"


class Tied(nn.Module):
    """A head read functionally by the root (never called) and a child called through
    ``.forward()``: neither runs a forward pre-hook of the module that owns the param."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 40)
        self.body = nn.Linear(40, 40)
        self.head = nn.Linear(40, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.body.forward(h))  # no hook of ``body`` runs
        return F.linear(h, self.head.weight, self.head.bias)  # nor of ``head``


def _model(seed: int = 0) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _opt(model, cls=shardopt.DistributedFusedAdam, **kw):
    return cls(
        model.parameters(), lr=0.02, weight_decay=0.05, bucket_cap_mb=300 * 4 / 2**20, **kw
    )  # several buckets, params straddling them


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * step + rank))


@contextlib.contextmanager
def _late_all_gathers():
    """The param all-gathers land in their output only when waited for (as a GPU stream sees
    an NCCL all-gather only after its wait): a read that does not wait reads the old params."""
    real = comm.all_gather

    def late(output, chunk, group, async_op=True):
        scratch = torch.empty_like(output)
        handle = real(scratch, chunk.clone(), group, async_op=True)

        class Late:
            def wait(self) -> None:
                handle.wait()
                output.copy_(scratch)

        return Late()

    comm.all_gather = late
    try:
        yield
    finally:
        comm.all_gather = real


def _train(model, opt, rank, steps, each=None):
    outs = []
    for step in range(steps):
        out = model(_data(rank, step))
        outs.append(out.detach().clone())
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if each is not None:
            each(step)
    return outs


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} [{i}]: off by {(x - y).abs().max().item():.3g}"


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def tied_and_direct_reads(rank, world):
    """Finding 4: with overlap_param_sync the next forward's functional and direct reads, and
    reads through ``parameters()`` between ``step()`` and that forward, see the new params."""
    model = _model()
    ref_outs = _train(model, _opt(model), rank, 4)
    ref = _params(model)
    for offload in (None, "cpu"):
        model = _model()
        opt = _opt(model, overlap_param_sync=True, offload=offload)
        with _late_all_gathers():
            outs = _train(model, opt, rank, 4)
            read = _params(model)  # through module.parameters(), no wait_param_sync()
        _same(ref_outs, outs, f"outputs (offload={offload})")
        _same(ref, read, f"params read through parameters() (offload={offload})")
        opt.close()


def dropped_without_close(rank, world):
    """Finding 2: an optimizer dropped after its last step, without close() or a wait, leaves
    the params updated, with offload and with a param-sync buffer of its own."""
    for kw in (dict(), dict(param_sync_dtype=torch.bfloat16)):
        model = _model()
        _train(model, _opt(model, **kw), rank, 3)
        ref = _params(model)
        for offload in (None, "cpu"):
            model = _model()
            opt = _opt(model, overlap_param_sync=True, offload=offload, **kw)
            _train(model, opt, rank, 3)
            gone = weakref.ref(opt)
            del opt
            assert gone() is None, "the optimizer is kept alive by a reference cycle"
            gc.collect()
            got = [p.detach().clone() for p in model.parameters()]
            _same(ref, got, f"params after the optimizer was dropped ({offload}, {kw})")


def _write(model, step: int) -> None:
    """A write through ``p.data`` after ``step``: WGAN's clipping, a scale, loaded weights."""
    with contextlib.suppress(IndexError):
        [
            lambda: [p.data.clamp_(-0.05, 0.05) for p in model.parameters()],
            lambda: model.body.weight.data.mul_(0.5),
            lambda: model.inp.weight.data.copy_(_model(seed=7).inp.weight),
        ][step]()


def writes_through_data(rank, world):
    """Finding 3: writes through ``p.data`` between steps hold with offload as without (fp32
    params are their own masters), with and without overlap_param_sync; LAMB takes the
    whole-shard offload path."""
    lamb = shardopt.DistributedFusedLAMB
    for cls, overlap in ((shardopt.DistributedFusedAdam, False), (lamb, False),
                         (shardopt.DistributedFusedAdam, True)):  # fmt: skip
        runs = []
        for offload in (None, "cpu"):
            model = _model()
            opt = _opt(model, cls, overlap_param_sync=overlap, offload=offload)
            history: list[list[torch.Tensor]] = []

            def each(step, model=model, opt=opt, history=history):
                _write(model, step)
                history.append(_params(model))

            outs = _train(model, opt, rank, 4, each)
            opt.wait_param_sync()
            runs.append((outs, history, _params(model)))
            opt.close()
        (o0, h0, p0), (o1, h1, p1) = runs
        what = f"{cls.__name__}, overlap={overlap}"
        _same(o0, o1, f"outputs ({what})")
        for step, (a, b) in enumerate(zip(h0, h1)):
            _same(a, b, f"params after the write of step {step} ({what})")
        _same(p0, p1, f"final params ({what})")


CASES = [tied_and_direct_reads, dropped_without_close, writes_through_data]
PLAN = [(1, CASES), (2, CASES), (3, CASES)]

results = plan_fixture(PLAN, ROOT, timeout=600)


@plan_params(PLAN)
def test_param_sync(results, world, case):
    results.check(world, case)
