"""FusedNovoGrad against the fp64 reference: norm types, init_zero, reg_inside_moment, state."""

import copy

import pytest
import torch
from conftest import (
    DTYPES,
    SIZE_CASES,
    SMALL_SHAPES,
    Parity,
    make_params,
    run_vs_reference,
    shapes_for,
    skip_unsupported,
)

from shardopt import FusedNovoGrad, reference


def _check_second_moment(run):
    """group["exp_avg_sq"] (one norm per param: fp32, fp64 for fp64 params) against the
    reference's 0-dim norms, at the param dtype's tolerance."""
    index = 0
    acc = torch.float64 if run.dtype == torch.float64 else torch.float32
    for group in run.opt.param_groups:
        v = group["exp_avg_sq"]
        assert v.dtype == acc and v.shape == (len(group["params"]),)
        for k in range(len(group["params"])):
            want = run.ref.state.get(index, {}).get(
                "exp_avg_sq", torch.zeros((), dtype=torch.float64)
            )
            if acc == torch.float64:
                torch.testing.assert_close(v[k].cpu(), want, rtol=1e-12, atol=1e-14)
            else:
                torch.testing.assert_close(v[k].double().cpu(), want, rtol=1e-5, atol=1e-7)
            index += 1


@pytest.mark.parametrize("reg_inside_moment", [False, True])
@pytest.mark.parametrize(
    "norm_type, init_zero",
    [(2, False), (2, True), (0, False), (0, True)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_options_match_reference(norm_type, init_zero, reg_inside_moment, dtype, device):
    skip_unsupported(dtype, device)
    run = run_vs_reference(
        FusedNovoGrad,
        reference.NovoGrad,
        SMALL_SHAPES,
        dtype,
        device,
        lr=0.01 if init_zero else 0.2,
        weight_decay=0.1,
        norm_type=norm_type,
        init_zero=init_zero,
        reg_inside_moment=reg_inside_moment,
        state_keys=("exp_avg",),
    )
    _check_second_moment(run)


@pytest.mark.parametrize(
    "options",
    [dict(grad_averaging=False), dict(bias_correction=False), dict(betas=(0.95, 0.98), eps=1e-4)],
    ids=["no-grad-averaging", "no-bias-correction", "betas-eps"],
)
def test_other_options_match_reference(options, device):
    run_vs_reference(
        FusedNovoGrad,
        reference.NovoGrad,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        weight_decay=0.05,
        state_keys=("exp_avg",),
        **options,
    )


@pytest.mark.parametrize("size, dtype", SIZE_CASES)
def test_sizes_match_reference(size, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedNovoGrad,
        reference.NovoGrad,
        shapes_for(size, device),
        dtype,
        device,
        steps=2 if size == "large" else 3,
        lr=2.0,
        weight_decay=0.01,
    )


def test_params_without_grads_are_skipped(device):
    run = run_vs_reference(
        FusedNovoGrad,
        reference.NovoGrad,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        state_keys=("exp_avg",),
        skip=lambda t, i: i == 1 or (i == 3 and t < 2),
    )
    _check_second_moment(run)
    assert run.opt.state.get(run.params[1], {}) == {}
    assert run.opt.param_groups[0]["exp_avg_sq"][1].item() == 0.0


def test_step_without_any_grad_is_a_noop(device):
    params = make_params(SMALL_SHAPES, torch.float32, device)
    start = [p.clone() for p in params]
    opt = FusedNovoGrad(params)
    opt.step()
    assert opt.param_groups[0]["step"] == 0 and len(opt.state) == 0
    assert all(torch.equal(p, s) for p, s in zip(params, start))


def test_state_dict_restores_the_second_moment_vector(device):
    run = Parity(
        FusedNovoGrad,
        reference.NovoGrad,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        weight_decay=0.1,
    )
    for _ in range(2):
        run.step()
    sd = copy.deepcopy(run.opt.state_dict())
    clone = [p.clone() for p in run.params]
    other = FusedNovoGrad(clone, lr=1e-2, weight_decay=0.1)
    other.load_state_dict(sd)
    v = other.param_groups[0]["exp_avg_sq"]
    assert v.device == device and v.dtype == torch.float32
    assert torch.equal(v, run.opt.param_groups[0]["exp_avg_sq"])
    for _ in range(2):
        grads = run.step()
        for q, g in zip(clone, grads):
            q.grad = g.clone()
        other.step()
        run.check(state_keys=("exp_avg",))
        for p, q in zip(run.params, clone):
            assert torch.equal(p, q)


def test_fp64_keeps_the_second_moment_in_fp64():
    """Regression: the per-tensor second moment was an fp32 vector even for fp64 params (2e-10
    relative error after a few steps); it now follows the params' precision."""
    run = run_vs_reference(
        FusedNovoGrad,
        reference.NovoGrad,
        SMALL_SHAPES,
        torch.float64,
        torch.device("cpu"),
        steps=5,
        lr=0.2,
        weight_decay=0.1,
        state_keys=("exp_avg",),
    )
    v = run.opt.param_groups[0]["exp_avg_sq"]
    assert v.dtype == torch.float64
    want = torch.stack([run.ref.state[i]["exp_avg_sq"] for i in range(len(SMALL_SHAPES))])
    assert float(((v - want).abs() / want.abs()).max()) < 1e-13
    # and a state dict round trip keeps it fp64
    clone = [p.detach().clone() for p in run.params]
    other = FusedNovoGrad(clone, lr=0.2, weight_decay=0.1)
    other.load_state_dict(run.opt.state_dict())
    assert other.param_groups[0]["exp_avg_sq"].dtype == torch.float64
    assert torch.equal(other.param_groups[0]["exp_avg_sq"], v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm_type", [2, 0])
def test_a_captured_step_replays_as_eager(norm_type):
    """FusedNovoGrad has no capturable mode (its step count lives on the host), but without bias
    correction its step does not depend on it: a step captured in a CUDA graph (norms, the blend
    of the second moments in place and the update: one kernel call) replays as eager steps."""
    shapes = [(300, 70), (7,), (1,), (65536 + 3,)]
    torch.manual_seed(0)
    start = [torch.randn(s, device="cuda") for s in shapes]
    kw = dict(lr=1e-2, weight_decay=0.1, bias_correction=False, norm_type=norm_type)
    graphed = [torch.nn.Parameter(t.clone()) for t in start]
    eager = [torch.nn.Parameter(t.clone()) for t in start]
    opts = [FusedNovoGrad(graphed, **kw), FusedNovoGrad(eager, **kw)]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(6)]
    for p, g in zip(graphed, grads[0]):
        p.grad = g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):  # warm-up: state, then the planned path
            for p, g in zip(graphed, grads[k]):
                p.grad.copy_(g)
            opts[0].step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opts[0].step()
    for k in range(6):
        for p, g in zip(eager, grads[k]):
            p.grad = g.clone()
        opts[1].step()
        if k >= 3:
            for p, g in zip(graphed, grads[k]):
                p.grad.copy_(g)
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(graphed, eager):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                opts[0].param_groups[0]["exp_avg_sq"],
                opts[1].param_groups[0]["exp_avg_sq"],
                rtol=0,
                atol=0,
            )
