"""FusedAdagrad against the fp64 reference and torch.optim.Adagrad."""

import pytest
import torch
from conftest import (
    DTYPES,
    SIZE_CASES,
    SMALL_SHAPES,
    assert_close_to,
    make_tensors,
    run_vs_reference,
    shapes_for,
    skip_unsupported,
)

from shardopt import FusedAdagrad, reference

STATE = ("sum",)

OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(weight_decay=0.1), id="l2-wd"),
    pytest.param(dict(weight_decay=0.1, adagrad_w_mode=True), id="w-mode-wd"),
    pytest.param(dict(adagrad_w_mode=True), id="w-mode-no-wd"),
    pytest.param(dict(eps=1e-3, weight_decay=0.05), id="eps"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_options_match_reference(options, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedAdagrad,
        reference.Adagrad,
        SMALL_SHAPES,
        dtype,
        device,
        lr=2e-2,
        state_keys=STATE,
        **options,
    )


@pytest.mark.parametrize("size, dtype", SIZE_CASES)
def test_sizes_match_reference(size, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedAdagrad,
        reference.Adagrad,
        shapes_for(size, device),
        dtype,
        device,
        steps=2 if size == "large" else 3,
        lr=5e-2,
        weight_decay=0.01,
        state_keys=STATE,
    )


def test_params_without_grads_are_skipped(device):
    run = run_vs_reference(
        FusedAdagrad,
        reference.Adagrad,
        SMALL_SHAPES,
        torch.float32,
        device,
        weight_decay=0.1,
        state_keys=STATE,
        skip=lambda t, i: i == 0 or (i == 3 and t == 0),
    )
    assert run.opt.state.get(run.params[0], {}) == {}
    assert torch.equal(run.params[0], run.start[0])


def test_step_without_any_grad_is_a_noop(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    start = [p.clone() for p in params]
    opt = FusedAdagrad(params)
    opt.step()
    assert opt.param_groups[0]["step"] == 0 and len(opt.state) == 0
    assert all(torch.equal(p, s) for p, s in zip(params, start))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adagrad(weight_decay, device):
    hp = dict(lr=0.05, eps=1e-9, weight_decay=weight_decay)
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    theirs = [p.clone() for p in params]
    opt, torch_opt = FusedAdagrad(params, **hp), torch.optim.Adagrad(theirs, **hp)
    for _ in range(5):
        for a, b in zip(params, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
        for a, b in zip(params, theirs):
            assert_close_to(a, b, torch.float32, "param")
            assert_close_to(opt.state[a]["sum"], torch_opt.state[b]["sum"], torch.float32, "sum")


def test_zero_grad_sets_none_by_default(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    opt = FusedAdagrad(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
