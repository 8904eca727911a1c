"""FusedSGD against the fp64 reference and torch.optim.SGD; zero_grad keeps grads by default."""

import pytest
import torch
from conftest import (
    DTYPES,
    LOW_DTYPES,
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


# -- fp16/bf16 params: torch.optim.SGD's param-dtype buffer and roundings -----------------------

# Hyperparameters that are not powers of 2, so every rounding point shows. ATen's CPU ops round
# an add's alpha to the tensor dtype in their vectorised loop and, in the scalar loop over the
# last elements of each work chunk (fewer than a vector), also round alpha * x apart; FusedSGD
# does what the vectorised loop does (docs/spec.md "FusedSGD"), so these tests use sizes that are
# whole vectors on every ISA (16 or 32 fp16/bf16 lanes) and a single work chunk (< 32,768).
LOW_OPTIONS = [
    pytest.param(dict(lr=0.1, momentum=0.9), id="momentum"),
    pytest.param(dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.03), id="dampening-wd"),
    pytest.param(dict(lr=0.07, momentum=0.8, nesterov=True, weight_decay=0.01), id="nesterov-wd"),
    pytest.param(dict(lr=0.1, weight_decay=0.02), id="no-momentum-wd"),
    pytest.param(dict(lr=0.1, momentum=0.9, maximize=True), id="maximize"),
]


def _against_torch_sgd(n: int, dtype, device, steps: int, **hp):
    params = [torch.randn(n).to(dtype).to(device)]
    theirs = [p.clone() for p in params]
    start = params[0].clone()
    ours_opt = FusedSGD(params, **hp)
    torch_opt = torch.optim.SGD(theirs, foreach=False, **hp)
    for _ in range(steps):
        grad = torch.randn(n).to(dtype).to(device)
        params[0].grad, theirs[0].grad = grad.clone(), grad.clone()
        ours_opt.step()
        torch_opt.step()
    assert not torch.equal(params[0], start)
    return params[0], theirs[0], ours_opt.state[params[0]], torch_opt.state[theirs[0]]


def _assert_equal(got, want, what):
    differ = int((got != want).sum())
    assert differ == 0, f"{what}: {differ} of {got.numel()} elements differ from torch.optim.SGD"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_low_precision_params_equal_torch_sgd_elementwise(dtype, device):
    """The issue's case: 7 steps of lr=0.25, momentum=0.125 on 20,000 params: every element and
    the buffer (in the param dtype) equal torch.optim.SGD(foreach=False)'s."""
    ours, theirs, state, torch_state = _against_torch_sgd(
        20_000, dtype, device, 7, lr=0.25, momentum=0.125
    )
    _assert_equal(ours, theirs, "param")
    assert state["momentum_buffer"].dtype == dtype
    _assert_equal(state["momentum_buffer"], torch_state["momentum_buffer"], "momentum_buffer")


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("options", LOW_OPTIONS)
def test_low_precision_options_equal_torch_sgd_elementwise(options, dtype, device):
    ours, theirs, state, torch_state = _against_torch_sgd(4096, dtype, device, 5, **options)
    _assert_equal(ours, theirs, "param")
    if options.get("momentum"):
        _assert_equal(state["momentum_buffer"], torch_state["momentum_buffer"], "momentum_buffer")


def test_low_precision_state_dict_round_trips_through_torch_sgd():
    """The buffer keeps the param dtype through torch.optim.SGD's state dict and back."""
    p = torch.randn(64).half()
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn_like(p)
    opt.step()
    q = p.clone()
    theirs = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    theirs.load_state_dict(opt.state_dict())
    assert theirs.state[q]["momentum_buffer"].dtype == torch.float16
    back = FusedSGD([p], lr=0.1, momentum=0.9)
    back.load_state_dict(theirs.state_dict())
    assert torch.equal(back.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
