"""DTensor params in the single-process optimizers (FSDP2 and tensor parallel), on 2 gloo ranks.

FSDP2 (``fully_shard``) on CPU: FusedAdam/FusedSGD/FusedAdagrad match torch.optim on the same
sharded model (state kept as DTensors, as torch's); FusedLAMB and FusedNovoGrad on FSDP2 match
the same optimizer on the unsharded model fed the rank-averaged grads (their per-tensor norms are
all-reduced over the mesh). Hand-made DTensors cover Shard(1), Replicate and uneven or empty
local shards. Other tensor subclasses are a TypeError.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_harness import run_cases

import shardopt

TOL = dict(rtol=1.3e-6, atol=1e-6)
#: where the cases run: CPU under gloo here; tests/optimizers/nccl_dtensor.py sets a GPU under NCCL
DEVICE = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 3 outputs: uneven shards over 2 ranks (2 + 1 rows)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(DEVICE)


def _data(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + 1000 * rank)
    return torch.randn(4, 8, generator=gen).to(DEVICE)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


ELEMENTWISE = [
    (
        lambda ps: shardopt.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
    (
        lambda ps: shardopt.FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    ),
    (
        lambda ps: shardopt.FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=0.01),
    ),
]


def fsdp2_elementwise_match_torch(rank, world):
    from torch.distributed.tensor import DTensor

    for make, make_torch in ELEMENTWISE:
        ours, theirs = _fsdp(_model()), _fsdp(_model())
        opt, ref = make(list(ours.parameters())), make_torch(list(theirs.parameters()))
        for step in range(3):
            for model, o in ((ours, opt), (theirs, ref)):
                _loss(model, _data(step, rank)).backward()
                o.step()
                o.zero_grad()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert isinstance(a, DTensor)
            torch.testing.assert_close(_full(a), _full(b), **TOL)
        # state as torch keeps it: DTensors with the param's placements, in the state dict too
        p = next(ours.parameters())
        for name, value in opt.state[p].items():
            assert isinstance(value, DTensor) and value.placements == p.placements, name
        sd = opt.state_dict()
        want = set(ref.state_dict()["state"][0]) - {"step"}  # torch.optim.SGD keeps no step
        assert set(sd["state"][0]) - {"step"} == want
        # and it loads back into a fresh optimizer on another FSDP2 copy of the model
        other = _fsdp(_model())
        o2 = make(list(other.parameters()))
        o2.load_state_dict(copy.deepcopy(sd))
        for name, value in o2.state[next(other.parameters())].items():
            assert isinstance(value, DTensor), name


def _averaged_grads(model: nn.Module, step: int, world: int) -> list[torch.Tensor]:
    """FSDP2's reduce-scatter averages: the mean over ranks of each rank's batch grads."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        _loss(model, _data(step, r)).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / world
    return grads


NORMED = [
    lambda ps: shardopt.FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.05),
    lambda ps: shardopt.FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: shardopt.FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: shardopt.FusedNovoGrad(ps, lr=1e-2, norm_type=0, init_zero=True),
]


def fsdp2_lamb_novograd_match_unsharded(rank, world):
    for make in NORMED:
        sharded, plain = _fsdp(_model()), _model()
        opt, ref = make(list(sharded.parameters())), make(list(plain.parameters()))
        for step in range(3):
            _loss(sharded, _data(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            for p, g in zip(plain.parameters(), _averaged_grads(plain, step, world), strict=True):
                p.grad = g
            ref.step()
        for a, b in zip(sharded.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(_full(a), b.detach(), **TOL)


def handmade_placements_match_unsharded(rank, world):
    """Shard(0) uneven and empty on one rank, Shard(1), Replicate: the norms are reduced only
    over the mesh dims a tensor is sharded on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE.type, (world,))
    shapes = [(3, 5), (1,), (4, 6), (7,)]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]]
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
    for make in [*NORMED, ELEMENTWISE[0][0]]:
        dts = [
            nn.Parameter(distribute_tensor(f.clone(), mesh, pl))
            for f, pl in zip(full, placements, strict=True)
        ]
        plain = [nn.Parameter(f.clone()) for f in full]
        opt, ref = make(dts), make(plain)
        for step in range(3):
            g = torch.Generator().manual_seed(50 + step)
            grads = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
            for p, q, grad, pl in zip(dts, plain, grads, placements, strict=True):
                p.grad = distribute_tensor(grad.clone(), mesh, pl)
                q.grad = grad.clone()
            opt.step()
            ref.step()
        for a, b in zip(dts, plain, strict=True):
            torch.testing.assert_close(a.full_tensor(), b.detach(), **TOL)


CASES = [
    fsdp2_elementwise_match_torch,
    fsdp2_lamb_novograd_match_unsharded,
    handmade_placements_match_unsharded,
]


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_dtensor(results, case):
    err = results[case.__name__]
    assert err is None, err


class _Wrapped(torch.Tensor):
    """A tensor subclass that is not a DTensor."""


@pytest.mark.parametrize(
    "cls",
    [
        shardopt.FusedAdam,
        shardopt.FusedLAMB,
        shardopt.FusedNovoGrad,
        shardopt.FusedAdagrad,
        shardopt.FusedMixedPrecisionLamb,
        lambda ps: shardopt.FusedSGD(ps, lr=0.1),
    ],
)
def test_other_tensor_subclasses_are_a_type_error(cls):
    odd = torch.zeros(3).as_subclass(_Wrapped)
    with pytest.raises(
        TypeError, match=r"param 1 is a .*test_dtensor\._Wrapped, a tensor subclass"
    ):
        cls([torch.zeros(2), odd])
