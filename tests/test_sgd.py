"""FusedSGD against the fp64 reference and torch.optim.SGD; zero_grad keeps grads by default."""

import pytest
import torch
from conftest import (
    DTYPES,
    SIZE_CASES,
    SMALL_SHAPES,
    Parity,
    assert_close_to,
    make_tensors,
    run_vs_reference,
    shapes_for,
    skip_unsupported,
)

from shardopt import FusedSGD, reference

STATE = ("momentum_buffer",)

OPTIONS = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(weight_decay=0.1), id="wd"),
    pytest.param(dict(momentum=0.9), id="momentum"),
    pytest.param(dict(momentum=0.9, dampening=0.3, weight_decay=0.1), id="dampening-wd"),
    pytest.param(dict(momentum=0.9, nesterov=True, weight_decay=0.1), id="nesterov-wd"),
    pytest.param(dict(momentum=0.8, weight_decay=0.1, wd_after_momentum=True), id="wd-after"),
    pytest.param(
        dict(momentum=0.8, nesterov=True, weight_decay=0.2, wd_after_momentum=True),
        id="nesterov-wd-after",
    ),
    pytest.param(dict(weight_decay=0.1, wd_after_momentum=True), id="wd-after-no-momentum"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_options_match_reference(options, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedSGD, reference.SGD, SMALL_SHAPES, dtype, device, lr=0.02, state_keys=STATE, **options
    )


@pytest.mark.parametrize("size, dtype", SIZE_CASES)
def test_sizes_match_reference(size, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedSGD,
        reference.SGD,
        shapes_for(size, device),
        dtype,
        device,
        steps=2 if size == "large" else 3,
        lr=0.02,
        momentum=0.9,
        weight_decay=0.01,
        state_keys=STATE,
    )


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_params_without_grads_are_skipped_and_late_buffers_start_from_the_grad(momentum, device):
    # param 1 never has a grad; param 2 gets its first grad (and buffer) on the third step
    run = run_vs_reference(
        FusedSGD,
        reference.SGD,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=0.05,
        momentum=momentum,
        nesterov=momentum > 0,
        state_keys=STATE,
        skip=lambda t, i: i == 1 or (i == 2 and t < 2),
    )
    assert "momentum_buffer" not in run.opt.state.get(run.params[1], {})
    assert torch.equal(run.params[1], run.start[1])


def test_step_without_any_grad_is_a_noop(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    start = [p.clone() for p in params]
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    opt.step()
    assert opt.param_groups[0]["step"] == 0 and len(opt.state) == 0
    assert all(torch.equal(p, s) for p, s in zip(params, start))


@pytest.mark.parametrize(
    "hp",
    [
        dict(lr=0.05),
        dict(lr=0.05, weight_decay=0.05),
        dict(lr=0.05, momentum=0.9, weight_decay=0.05),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.05),
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05),
    ],
    ids=["plain", "wd", "momentum", "dampening", "nesterov"],
)
def test_matches_torch_sgd(hp, device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    theirs = [p.clone() for p in params]
    opt, torch_opt = FusedSGD(params, **hp), torch.optim.SGD(theirs, **hp)
    for _ in range(5):
        for a, b in zip(params, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
        for a, b in zip(params, theirs):
            assert_close_to(a, b, torch.float32, "param")
    if hp.get("momentum"):
        for a, b in zip(params, theirs):
            assert_close_to(
                opt.state[a]["momentum_buffer"],
                torch_opt.state[b]["momentum_buffer"],
                torch.float32,
                "momentum_buffer",
            )


def test_lr_scheduler_changes_the_lr_used(device):
    run = Parity(FusedSGD, reference.SGD, SMALL_SHAPES, torch.float32, device, lr=0.1, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(run.opt, step_size=1, gamma=0.5)
    for t in range(4):
        assert run.opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**t)
        run.ref.param_groups[0]["lr"] = 0.1 * 0.5**t
        run.step()
        run.check(state_keys=STATE)
        scheduler.step()


def test_zero_grad_keeps_zeroed_grads_by_default(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    opt = FusedSGD(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt = FusedSGD(params, lr=0.1, set_grad_none=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
