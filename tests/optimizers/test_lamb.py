"""FusedLAMB against the fp64 reference: trust ratio, nvlamb, global-norm clipping, modes."""

import pytest
import torch
from conftest import (
    DTYPES,
    LOW_DTYPES,
    SIZE_CASES,
    SMALL_SHAPES,
    make_params,
    make_tensors,
    run_vs_reference,
    shapes_for,
    skip_unsupported,
)

from shardopt import FusedLAMB, reference

STATE = ("exp_avg", "exp_avg_sq")


def _tolerance(dtype):
    """fp64 runs with clipping compare at fp32 tolerance: see test_fp64_clipping_is_fp64_exact."""
    return dict(compare_as=torch.float32) if dtype == torch.float64 else {}


OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(use_nvlamb=True, weight_decay=0.0), id="nvlamb-no-wd"),
    pytest.param(dict(use_nvlamb=False, weight_decay=0.0), id="no-nvlamb-no-wd"),
    pytest.param(dict(use_nvlamb=True, weight_decay=0.1), id="nvlamb-wd"),
    pytest.param(dict(grad_averaging=False), id="no-grad-averaging"),
    pytest.param(dict(adam_w_mode=False, weight_decay=0.1), id="l2-mode"),
    pytest.param(dict(bias_correction=False, betas=(0.8, 0.95)), id="no-bias-correction"),
    pytest.param(dict(max_grad_norm=0.1), id="clip-active"),
    pytest.param(dict(max_grad_norm=1e6), id="clip-inactive"),
    pytest.param(dict(max_grad_norm=0.0), id="clip-off-zero"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_options_match_reference(options, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        state_keys=STATE,
        **_tolerance(dtype),
        **options,
    )


def _global_norm(grads):
    return torch.sqrt(sum((g.double() ** 2).sum() for g in grads))


def test_clipping_is_really_active_and_changes_the_update(device):
    """With max_grad_norm=0.1 the grads (norm ~ 6) are clipped: the moments see g * 0.1 / N."""
    params = make_params(SMALL_SHAPES, torch.float32, device)
    grads = make_tensors(SMALL_SHAPES, torch.float32, device)
    norm = _global_norm(grads)
    assert norm > 1.0
    opt = FusedLAMB(params, lr=1e-2, max_grad_norm=0.1)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, g in zip(params, grads):
        torch.testing.assert_close(
            opt.state[p]["exp_avg"].double(), 0.1 * g.double() * 0.1 / norm, rtol=1e-5, atol=1e-9
        )


@pytest.mark.parametrize("max_grad_norm", [1e6, 0.0])
def test_fp64_without_clipping_is_fp64_exact(max_grad_norm):
    run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float64,
        torch.device("cpu"),
        lr=1e-2,
        max_grad_norm=max_grad_norm,
        weight_decay=0.1,
        state_keys=STATE,
    )


@pytest.mark.parametrize("max_grad_norm", [1e6, 0.0])
def test_no_clipping_keeps_the_raw_grad_in_the_moments(max_grad_norm, device):
    params = make_params(SMALL_SHAPES, torch.float32, device)
    grads = make_tensors(SMALL_SHAPES, torch.float32, device, std=100.0)
    opt = FusedLAMB(params, lr=1e-2, max_grad_norm=max_grad_norm)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, g in zip(params, grads):
        torch.testing.assert_close(opt.state[p]["exp_avg"], 0.1 * g, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "options",
    [dict(use_nvlamb=True, weight_decay=0.0), dict(weight_decay=0.01), dict(weight_decay=0.0)],
    ids=["nvlamb", "wd", "plain"],
)
def test_zero_norm_param_falls_back_to_lr(options, device):
    params = make_params(SMALL_SHAPES, torch.float32, device)
    params[1].zero_()
    run = run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float32,
        device,
        steps=1,
        params=params,
        lr=1e-2,
        max_grad_norm=0.0,
        state_keys=STATE,
        **options,
    )
    # ratio = lr for the zero tensor: its first update is lr * u with u = g/(|g|+eps) ~ sign(g)
    g = run.params[1].grad.double()
    expected = -1e-2 * g / (g.abs() + 1e-6)
    torch.testing.assert_close(run.params[1].double(), expected, rtol=1e-5, atol=1e-9)


def test_fp64_clipping_is_fp64_exact():
    run = run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float64,
        torch.device("cpu"),
        steps=1,
        lr=1e-2,
        max_grad_norm=0.1,
    )
    for p, r in zip(run.params, run.ref.params()):
        torch.testing.assert_close(p, r, rtol=1e-13, atol=1e-15)


def test_global_norm_spans_all_groups(device):
    """Clipping uses one norm over the grads of every group (max_grad_norm from the defaults)."""
    run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        [SMALL_SHAPES[:2], SMALL_SHAPES[2:]],
        torch.float32,
        device,
        group_options=[
            {"weight_decay": 0.0, "lr": 2e-2},
            {"weight_decay": 0.1, "max_grad_norm": 1e9},
        ],
        lr=1e-2,
        max_grad_norm=0.5,
        state_keys=STATE,
        skip=lambda t, i: i == 0 and t == 1,
    )


@pytest.mark.parametrize("size, dtype", SIZE_CASES)
def test_sizes_match_reference(size, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        shapes_for(size, device),
        dtype,
        device,
        steps=2 if size == "large" else 3,
        lr=1e-2,
        state_keys=STATE,
        **_tolerance(dtype),
    )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_master_weights_track_reference_in_fp32(dtype, device):
    run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        master_weights=True,
        master=True,
        state_keys=STATE,
    )


def test_params_without_grads_are_skipped(device):
    run = run_vs_reference(
        FusedLAMB,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        state_keys=STATE,
        skip=lambda t, i: i == 2 or (i == 0 and t == 0),
    )
    assert run.opt.state.get(run.params[2], {}) == {}
    assert torch.equal(run.params[2], run.start[2])


def test_step_without_any_grad_is_a_noop(device):
    params = make_params(SMALL_SHAPES, torch.float32, device)
    start = [p.clone() for p in params]
    opt = FusedLAMB(params)
    opt.step()
    assert opt.param_groups[0]["step"] == 0 and len(opt.state) == 0
    assert all(torch.equal(p, s) for p, s in zip(params, start))


def test_zero_grad_sets_none_by_default(device):
    params = make_params(SMALL_SHAPES, torch.float32, device)
    opt = FusedLAMB(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
