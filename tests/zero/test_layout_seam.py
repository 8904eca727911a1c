"""The shard-layout seam on gloo (worlds 1-4): DistributedFusedAdam gives the same bits under
ElementLayout and WholeParamLayout, fp32 and bf16 params (and FusedAdam's bits fed the averaged
grads, fp32, where the average is exact); LAMB, whose per-tensor norms are all-reduced, matches
FusedLAMB under both; checkpoints (``shardopt.checkpoint`` and ``state_dict()``) written under one
layout load under the other and at another world size (2 -> 3 -> 1), resuming as the run that
never stopped."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_plan import plan_fixture, plan_params

import shardopt
from shardopt import checkpoint
from shardopt.zero.layout import ElementLayout, WholeParamLayout

ROOT = "SHARDOPT_TEST_LAYOUT_SEAM_ROOT"
TOL = dict(rtol=1.3e-6, atol=1e-5)
SHAPES = [(33, 17), (17,), (5, 33), (7,), (3, 4, 5), (1,), (64, 3)]
BUCKET_MB = 96 * 4 / 2**20  # 96 fp32 elements: params straddle buckets and chunks
LAYOUTS = {"element": ElementLayout(), "whole": WholeParamLayout()}


def _root() -> Path:
    return Path(os.environ[ROOT])


def _params(dtype=torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    """Multiples of 1/8 in [-1, 1]: their sums over ranks are exact."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-8, 9, s, generator=gen).float() / 8 for s in SHAPES]


def _backward(params, step, rank) -> None:
    for p, g in zip(params, _grads(step, rank)):
        (p * g.to(p.dtype)).sum().backward()


def _mean_grads(step: int, world: int) -> list[torch.Tensor]:
    per_rank = [_grads(step, r) for r in range(world)]
    return [sum(gs) / world for gs in zip(*per_rank)]


def _run(cls, layout, steps, rank, dtype=torch.float32, **kw):
    params = _params(dtype)
    opt = cls(params, lr=0.01, weight_decay=0.01, bucket_cap_mb=BUCKET_MB, shard_layout=layout,
              **kw)  # fmt: skip
    for s in range(steps):
        _backward(params, s, rank)
        opt.step()
    return params, opt


def _reference(cls, steps, world, dtype=torch.float32, **kw):
    params = _params(dtype)
    opt = cls(params, lr=0.01, weight_decay=0.01, **kw)
    for s in range(steps):
        for p, g in zip(params, _mean_grads(s, world)):
            p.grad = g.to(p.dtype)
        opt.step()
    return params


def _equal(a, b, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), f"{what}: param {i} differs"


def adam_same_bits(rank, world):
    for dtype in (torch.float32, torch.bfloat16):
        element, e_opt = _run(shardopt.DistributedFusedAdam, LAYOUTS["element"], 3, rank, dtype)
        whole, w_opt = _run(shardopt.DistributedFusedAdam, LAYOUTS["whole"], 3, rank, dtype)
        assert all(
            len(k.layout.param_fragments(i)) == 1 for k in w_opt.keys for i in k.layout.params
        )
        if world > 1:  # the element layout cuts params at these bucket sizes
            assert any(
                len(k.layout.param_fragments(i)) > 1 for k in e_opt.keys for i in k.layout.params
            )
        _equal(element, whole, f"{dtype} element vs whole")
        se, sw = e_opt.state_dict(), w_opt.state_dict()
        for pid, entry in se["state"].items():
            for name, t in entry.items():
                assert torch.equal(t, sw["state"][pid][name]), f"{dtype} state {pid} {name}"
        if world in (1, 2, 4) and dtype == torch.float32:  # the average is exact
            ref = _reference(shardopt.FusedAdam, 3, world, dtype)
            _equal(ref, whole, f"{dtype} FusedAdam vs whole")


def lamb_matches(rank, world):
    element, _ = _run(shardopt.DistributedFusedLAMB, LAYOUTS["element"], 3, rank)
    whole, _ = _run(shardopt.DistributedFusedLAMB, LAYOUTS["whole"], 3, rank)
    ref = _reference(shardopt.FusedLAMB, 3, world)
    for i, (r, e, w) in enumerate(zip(ref, element, whole)):
        torch.testing.assert_close(e.detach(), r.detach(), **TOL, msg=f"element param {i}")
        torch.testing.assert_close(w.detach(), r.detach(), **TOL, msg=f"whole param {i}")


def layout_per_group(rank, world):
    """A subclass choosing per group (as DistributedFusedMuon does): the same bits again."""

    class PerGroup(shardopt.DistributedFusedAdam):
        def shard_layout(self, group):
            return WholeParamLayout() if group.get("whole") else ElementLayout()

    params = _params()
    groups = [{"params": params[:3], "whole": True}, {"params": params[3:]}]
    opt = PerGroup(groups, lr=0.01, weight_decay=0.01, bucket_cap_mb=BUCKET_MB)
    assert [opt.shard_layout(opt.param_groups[k.group_index]).name for k in opt.keys] == [
        "whole_param", "element"]  # fmt: skip
    for s in range(3):
        _backward(params, s, rank)
        opt.step()
    element, _ = _run(shardopt.DistributedFusedAdam, LAYOUTS["element"], 3, rank)
    _equal(element, params, "per-group layouts vs element")


def layouts_must_agree(rank, world):
    if world == 1:
        return
    layout = WholeParamLayout() if rank == 0 else ElementLayout()
    try:
        shardopt.DistributedFusedAdam(_params(), bucket_cap_mb=BUCKET_MB, shard_layout=layout)
    except ValueError as e:
        assert "shard layouts of group 0" in str(e)
    else:
        raise AssertionError("different layouts on different ranks were accepted")
    try:
        shardopt.DistributedFusedAdam(_params(), shard_layout="whole")
    except TypeError as e:
        assert "shard_layout must be a ShardLayout" in str(e)
    else:
        raise AssertionError("a string layout was accepted")


# -- checkpoints across layouts and world sizes (2 -> 3 -> 1) ---------------------------------


def _ckpt_run(name, layout, rank, world, start, stop, load=None, save_at=None):
    cls = getattr(shardopt, f"DistributedFused{name}")
    torch.manual_seed(123)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES] if load else _params()
    opt = cls(params, lr=0.01, weight_decay=0.01, bucket_cap_mb=BUCKET_MB, shard_layout=layout)
    if load is not None:
        load(opt, params)
    for s in range(start, stop):
        if s == save_at:
            checkpoint.save(_root() / f"{name}-{world}", opt, _module(params))
            sd = opt.state_dict()
            if rank == 0:
                torch.save((sd, [p.detach() for p in params]), _root() / f"{name}-{world}-sd.pt")
        world_grads = _mean_grads(s, 4)  # the same global grads at every world size
        for p, g in zip(params, world_grads):
            (p * g).sum().backward()
        opt.step()
    return params


def _module(params) -> nn.Module:
    m = nn.Module()
    for i, p in enumerate(params):
        m.register_parameter(f"p{i}", p)
    return m


def _compare(name, got, expected, exact):
    for i, (a, b) in enumerate(zip(got, expected)):
        if exact:
            assert torch.equal(a.detach(), b), f"{name} param {i}"
        else:
            torch.testing.assert_close(a.detach(), b, **TOL, msg=f"{name} param {i}")


def ckpt_save_whole_w2(rank, world):
    for name in ("Adam", "LAMB"):
        final = _ckpt_run(name, LAYOUTS["whole"], rank, world, 0, 4, save_at=2)
        if rank == 0:
            torch.save([p.detach() for p in final], _root() / f"{name}-final.pt")
        dist.barrier()


def _from_checkpoint(directory):
    return lambda opt, params: checkpoint.load(directory, opt, _module(params))


def _from_state_dict(path):
    def load(opt, params):
        sd, values = torch.load(path, weights_only=False)
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        opt.load_state_dict(sd)

    return load


def ckpt_resume_element_w2(rank, world):
    for name in ("Adam", "LAMB"):
        expected = torch.load(_root() / f"{name}-final.pt")
        for load in (
            _from_checkpoint(_root() / f"{name}-2"),
            _from_state_dict(_root() / f"{name}-2-sd.pt"),
        ):
            got = _ckpt_run(name, LAYOUTS["element"], rank, world, 2, 4, load=load)
            _compare(name, got, expected, exact=name == "Adam")  # LAMB: norms summed otherwise


def ckpt_resume_element_w3(rank, world):
    """Loads the whole-layout w2 checkpoint under the element layout at world 3, saves again."""
    for name in ("Adam", "LAMB"):
        expected = torch.load(_root() / f"{name}-final.pt")
        load = _from_checkpoint(_root() / f"{name}-2")
        got = _ckpt_run(name, LAYOUTS["element"], rank, world, 2, 4, load=load, save_at=2)
        _compare(name, got, expected, exact=False)


def ckpt_resume_whole_w1(rank, world):
    for name in ("Adam", "LAMB"):
        expected = torch.load(_root() / f"{name}-final.pt")
        for load in (
            _from_checkpoint(_root() / f"{name}-3"),
            _from_state_dict(_root() / f"{name}-3-sd.pt"),
        ):
            got = _ckpt_run(name, LAYOUTS["whole"], rank, world, 2, 4, load=load)
            _compare(name, got, expected, exact=False)


BITS = [adam_same_bits, lamb_matches, layout_per_group, layouts_must_agree]
PLAN = [
    (1, BITS),
    (2, [*BITS, ckpt_save_whole_w2, ckpt_resume_element_w2]),
    (3, [*BITS, ckpt_resume_element_w3]),
    (4, BITS),
    (1, [ckpt_resume_whole_w1]),
]

results = plan_fixture(PLAN, ROOT, timeout=600, pg_timeout=60)


@plan_params(PLAN)
def test_layout_seam(results, world, case):
    results.check(world, case)
