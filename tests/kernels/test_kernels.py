"""The norm, scale, LAMB stage and NovoGrad step kernels and SGD's device first-run flag through
shardopt.kernels: determinism, accuracy, inf/nan, dtypes, and the work moved into the kernels
(LAMB's clip factor and square roots, NovoGrad's norms and blend) against the torch ops it
replaced."""

import math

import pytest
import torch
from conftest import DTYPES, assert_close_to, make_tensors, skip_unsupported

from shardopt import kernels

# fp32 accumulation over 16384-element chunks (typical error sqrt(n) * 6e-8); fp64 in fp64
NORM_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float64: 1e-13}


def _shapes(device):
    return [(278011,), (kernels.chunk_size(device) + 5,), (1,), (7,), (0,), (3, 4)]


def test_norm_is_bitwise_deterministic_across_runs_and_thread_counts(device):
    tensors = make_tensors(_shapes(device), torch.float32, device)
    first = kernels.norm(tensors)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            for _ in range(3):
                total, per = kernels.norm(tensors)
                assert torch.equal(total, first[0]) and torch.equal(per, first[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_per_tensor_and_total_match_fp64(dtype, device):
    skip_unsupported(dtype, device)
    tensors = make_tensors(_shapes(device), dtype, device)
    total, per = kernels.norm(tensors)
    assert total.dtype == per.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert total.shape == () and per.shape == (len(tensors),) and per.device == device
    want = torch.stack([torch.linalg.vector_norm(t.double().cpu()) for t in tensors])
    rtol = NORM_TOL[dtype]
    torch.testing.assert_close(per.sqrt().double().cpu(), want, rtol=rtol, atol=0)
    torch.testing.assert_close(
        total.sqrt().double().cpu(), torch.linalg.vector_norm(want), rtol=rtol, atol=0
    )
    assert per[4].item() == 0.0  # the empty tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_norm_is_exact(dtype, device):
    skip_unsupported(dtype, device)
    tensors = make_tensors(_shapes(device), dtype, device)
    total, per = kernels.norm(tensors, max_norm=True)
    want = [t.abs().max().double().item() if t.numel() else 0.0 for t in tensors]
    assert per.double().cpu().tolist() == want
    assert total.item() == max(want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("max_norm", [False, True])
def test_norm_propagates_nan_and_inf(bad, max_norm, device):
    tensors = make_tensors([(kernels.chunk_size(device) + 100,), (5,), (3,)], torch.float32, device)
    tensors[0][kernels.chunk_size(device) + 1] = bad
    total, per = kernels.norm(tensors, max_norm=max_norm)
    expect_nan = math.isnan(bad)
    for value in (total.item(), per[0].item()):
        assert math.isnan(value) if expect_nan else value == math.inf
    assert torch.isfinite(per[1:]).all()


def test_norm_of_empty_list_is_zero():
    total, per = kernels.norm([])
    assert total.shape == () and total.item() == 0.0
    assert per.shape == (0,)


def test_norm_of_mixed_dtypes_is_fp32_and_correct(device):
    tensors = [
        torch.randn(1000).to(device),
        torch.randn(17).half().to(device),
        torch.randn(20000).bfloat16().to(device),
    ]
    if device.type == "cpu":
        tensors.append(torch.randn(9, dtype=torch.float64))
    total, per = kernels.norm(tensors)
    assert total.dtype == per.dtype == torch.float32
    want = torch.stack([torch.linalg.vector_norm(t.double().cpu()) for t in tensors])
    torch.testing.assert_close(per.sqrt().double().cpu(), want, rtol=1e-5, atol=0)
    _, per_max = kernels.norm(tensors, max_norm=True)
    assert per_max.cpu().tolist() == [t.abs().max().float().item() for t in tensors]


@pytest.mark.parametrize(
    "src_dtype, dst_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float64, torch.float64),
    ],
)
def test_scale_multiplies_and_casts(src_dtype, dst_dtype, device):
    skip_unsupported(src_dtype, device)
    src = make_tensors([(kernels.chunk_size(device) + 5,), (1,), (7,)], src_dtype, device)
    dst = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    found_inf = torch.zeros(1, device=device)
    kernels.scale(src, dst, found_inf, scale=0.125)
    acc = torch.float64 if src_dtype == torch.float64 else torch.float32
    for s, d in zip(src, dst):
        assert torch.equal(d, (s.to(acc) * 0.125).to(dst_dtype))
    assert found_inf.item() == 0.0
    scale_t = torch.tensor([4.0], device=device)
    kernels.scale(src, dst, found_inf, scale=0.125, scale_t=scale_t)  # the tensor wins
    for s, d in zip(src, dst):
        assert torch.equal(d, (s.to(acc) * 4.0).to(dst_dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_scale_sets_found_inf_and_works_in_place(bad, device):
    src = make_tensors([(kernels.chunk_size(device) + 5,), (3,)], torch.float32, device)
    src[0][-1] = bad
    expect = [(s * 0.5) for s in src]
    found_inf = torch.zeros(1, device=device)
    kernels.scale(src, src, found_inf, scale=0.5)
    assert found_inf.item() == 1.0
    torch.testing.assert_close(src[1], expect[1], rtol=0, atol=0)
    torch.testing.assert_close(src[0][:-1], expect[0][:-1], rtol=0, atol=0)
    clean = make_tensors([(5,)], torch.float32, device)
    flag = torch.zeros(1, device=device)
    kernels.scale(clean, clean, flag, scale=2.0)
    assert flag.item() == 0.0


def test_scale_of_empty_list_is_a_noop():
    flag = torch.zeros(1)
    kernels.scale([], [], flag, scale=2.0)
    assert flag.item() == 0.0


# -- LAMB stages: per-tensor sums of squares taken in the moment pass ---------------------------

LAMB_ARGS = dict(beta1=0.9, beta2=0.99, eps=1e-6, step=3, bias_correction=True, weight_decay=0.1)
# (grad dtype, param dtype): the dtype signatures FusedLAMB hands the kernels (masters: bf16 grad)
LAMB_SIGNATURES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.float16, torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float64, torch.float64, id="fp64"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-grad-fp32-master"),
]


def _lamb_inputs(shapes, grad_dtype, param_dtype, device):
    """[grads, params, exp_avg, exp_avg_sq] with nonzero moments (state in the acc dtype)."""
    acc = torch.float64 if param_dtype == torch.float64 else torch.float32
    grads = make_tensors(shapes, grad_dtype, device)
    params = make_tensors(shapes, param_dtype, device)
    exp_avg = make_tensors(shapes, acc, device, std=0.1)
    exp_avg_sq = [(t * t).to(acc).to(device) for t in make_tensors(shapes, torch.float32, device)]
    return [grads, params, exp_avg, exp_avg_sq]


def _clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


def _stage1(lists, adam_w_mode=True, **kwargs):
    return kernels.lamb_stage1(
        lists, grad_averaging=True, adam_w_mode=adam_w_mode, **LAMB_ARGS, **kwargs
    )


def _reference_sums(lists, grad_scale, adam_w_mode):
    """fp64 (w_sq, u_sq, exp_avg, exp_avg_sq) from the inputs, with torch ops (docs/spec.md)."""
    b1, b2, eps, wd, t = (LAMB_ARGS[k] for k in ("beta1", "beta2", "eps", "weight_decay", "step"))
    w_sq, u_sq, ms, vs = [], [], [], []
    for g, p, m, v in zip(*[[x.detach().cpu().double() for x in lst] for lst in lists]):
        g = g * grad_scale
        if not adam_w_mode:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps)
        if adam_w_mode:
            u = u + wd * p
        w_sq.append((p * p).sum())
        u_sq.append((u * u).sum())
        ms.append(m)
        vs.append(v)
    return torch.stack(w_sq), torch.stack(u_sq), ms, vs


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("grad_dtype, param_dtype", LAMB_SIGNATURES)
def test_lamb_stage1_sums_match_fp64(grad_dtype, param_dtype, adam_w_mode, device):
    skip_unsupported(param_dtype, device)
    lists = _lamb_inputs(_shapes(device), grad_dtype, param_dtype, device)
    want_w, want_u, want_m, want_v = _reference_sums(lists, 0.5, adam_w_mode)
    grad_scale_t = torch.tensor([0.5], device=device)
    w_sq, u_sq = _stage1(lists, adam_w_mode=adam_w_mode, grad_scale_t=grad_scale_t)
    acc = torch.float64 if param_dtype == torch.float64 else torch.float32
    assert w_sq.dtype == u_sq.dtype == acc
    assert w_sq.shape == u_sq.shape == (len(lists[0]),) and w_sq.device == device
    rtol = NORM_TOL[param_dtype]
    torch.testing.assert_close(w_sq.sqrt().double().cpu(), want_w.sqrt(), rtol=rtol, atol=0)
    torch.testing.assert_close(u_sq.sqrt().double().cpu(), want_u.sqrt(), rtol=rtol, atol=0)
    assert w_sq[4].item() == u_sq[4].item() == 0.0  # the empty tensor
    for i, (m, v) in enumerate(zip(lists[2], lists[3])):  # the moments were updated in place
        assert_close_to(m, want_m[i], acc, f"exp_avg {i}")
        assert_close_to(v, want_v[i], acc, f"exp_avg_sq {i}")


def test_lamb_stage1_sums_are_bitwise_deterministic_across_runs_and_thread_counts(device):
    lists = _lamb_inputs(_shapes(device), torch.float32, torch.float32, device)
    first = _stage1(_clone(lists))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            for _ in range(2):
                w_sq, u_sq = _stage1(_clone(lists))
                assert torch.equal(w_sq, first[0]) and torch.equal(u_sq, first[1])
    finally:
        torch.set_num_threads(threads)


def test_lamb_stage1_sums_of_mixed_dtypes_come_back_in_caller_order(device):
    """One call with several dtype signatures (one kernel launch each) gives the same per-tensor
    sums, in the caller's order, as a call per tensor."""
    signatures = [(torch.float32, torch.float32), (torch.float16, torch.float16)]
    signatures += [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    if device.type == "cpu":
        signatures.append((torch.float64, torch.float64))
    shapes = [(kernels.chunk_size(device) + 5,), (7,), (300,), (1,), (9,)]
    parts = [_lamb_inputs([s], g, p, device) for s, (g, p) in zip(shapes, signatures)]
    lists = [[part[k][0] for part in parts] for k in range(4)]
    w_sq, u_sq = _stage1(_clone(lists))
    acc = torch.float64 if device.type == "cpu" else torch.float32
    assert w_sq.dtype == u_sq.dtype == acc and w_sq.shape == (len(parts),)
    for i, part in enumerate(parts):
        w_one, u_one = _stage1(_clone(part))
        assert w_sq[i].item() == w_one.item() and u_sq[i].item() == u_one.item()


def test_lamb_found_inf_leaves_param_and_moments_unchanged_through_both_stages(device):
    lists = _lamb_inputs(_shapes(device), torch.float32, torch.float32, device)
    start = _clone(lists)
    found_inf_t = torch.ones(1, device=device)
    w_sq, u_sq = _stage1(lists, found_inf_t=found_inf_t)
    assert not w_sq.any() and not u_sq.any()
    params, exp_avg, exp_avg_sq = lists[1:]
    outs = [torch.full_like(p, 7.0, dtype=torch.bfloat16) for p in params]
    out_start = [o.clone() for o in outs]
    kernels.lamb_stage2(
        [params, exp_avg, exp_avg_sq, outs],
        torch.ones(len(params), device=device),
        torch.ones(len(params), device=device),
        lr=0.1,
        adam_w_mode=True,
        use_nvlamb=True,
        found_inf_t=found_inf_t,
        **LAMB_ARGS,
    )
    for k in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(lists[k], start[k], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outs, out_start, strict=True))


def _exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """A correctly rounded square root in ``t``'s dtype (torch's CPU sqrt may be an ulp off;
    the kernels' is not): through Python's double sqrt, exact for fp32 after rounding."""
    flat = [math.sqrt(x) for x in t.detach().double().cpu().reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(t.shape).to(t.dtype).to(t.device)


def _clip_factor(total_sq, max_grad_norm, inv_scale=None):
    """LAMB's clip factor (the kernel's lamb::clip_scale as fp32 torch ops) from an exactly
    rounded norm."""
    norm = _exact_sqrt(total_sq.reshape(1))
    if inv_scale is not None:
        norm = norm * inv_scale
    factor = torch.where(norm > max_grad_norm, max_grad_norm / norm, torch.ones_like(norm))
    return factor if inv_scale is None else factor * inv_scale


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scale", "inv-scale"])
@pytest.mark.parametrize("max_grad_norm", [0.5, 1e6, 0.0], ids=["clips", "no-clip", "off"])
def test_lamb_stage1_clip_factor_from_the_norm_equals_a_given_grad_scale(
    max_grad_norm, scaled, device
):
    """Stage 1 computes the clip factor from the grads' sum of squares on the device (no tensor op
    between the norm and the stage): the bits of stage 1 given that factor as grad_scale_t."""
    lists = _lamb_inputs(_shapes(device), torch.float32, torch.float32, device)
    total_sq, _ = kernels.norm(lists[0])
    inv = torch.tensor([0.25], device=device) if scaled else None
    a, b = _clone(lists), _clone(lists)
    got = _stage1(a, grad_norm_sq_t=total_sq, max_grad_norm=max_grad_norm, grad_scale_t=inv)
    if max_grad_norm > 0:
        factor = _clip_factor(total_sq, max_grad_norm, inv)
    else:
        factor = inv if inv is not None else torch.ones(1, device=device)
    want = _stage1(b, grad_scale_t=factor)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for k in (2, 3):
        assert all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True))
    if max_grad_norm == 0.5:
        assert factor.item() < (0.25 if scaled else 1.0)  # the clip was taken


def test_lamb_stage2_takes_sums_of_squares(device):
    """squared=True: the kernel takes the square roots of stage 1's sums itself."""
    lists = _lamb_inputs(_shapes(device), torch.float32, torch.float32, device)
    w_sq, u_sq = _stage1(lists)
    stage2 = dict(lr=0.1, adam_w_mode=True, use_nvlamb=False, **LAMB_ARGS)
    a, b = _clone(lists[1:]), _clone(lists[1:])
    kernels.lamb_stage2(a, w_sq, u_sq, squared=True, **stage2)
    kernels.lamb_stage2(b, _exact_sqrt(w_sq), _exact_sqrt(u_sq), **stage2)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a[0], lists[1], strict=True))


# -- NovoGrad in one call: norms, blend and update ----------------------------------------------

NOVOGRAD_ARGS = dict(
    lr=0.05, beta1=0.9, beta2=0.98, eps=1e-8, step=3, bias_correction=True, weight_decay=0.1,
    grad_averaging=True, moment_mode=1,
)  # fmt: skip


def _novograd_lists(device, grad_dtype=torch.float32, param_dtype=torch.float32):
    shapes = _shapes(device)
    acc = torch.float64 if param_dtype == torch.float64 else torch.float32
    return [
        make_tensors(shapes, grad_dtype, device),
        make_tensors(shapes, param_dtype, device),
        make_tensors(shapes, acc, device, std=0.1),
    ]


@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("init_zero", [False, True])
@pytest.mark.parametrize(
    "grad_dtype, param_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float64, torch.float64)],
    ids=["fp32", "bf16", "fp64"],
)  # fmt: skip
def test_novograd_step_equals_norm_blend_and_update(
    norm_type, init_zero, grad_dtype, param_dtype, device
):
    """novograd_step (one call) gives the bits of the three steps it fuses: kernels.norm, the blend
    of blend_second_moment (torch ops) and kernels.novograd, with some params on their first update;
    the second moments come back in place."""
    from shardopt.algorithms.novograd import blend_second_moment

    skip_unsupported(param_dtype, device)
    lists = _novograd_lists(device, grad_dtype, param_dtype)
    n = len(lists[0])
    acc = torch.float64 if param_dtype == torch.float64 else torch.float32
    v0 = (torch.rand(n, dtype=acc) + 0.5).to(device)
    fresh = torch.tensor([i % 2 == 0 for i in range(n)], device=device)
    hyper = dict(NOVOGRAD_ARGS, init_zero=init_zero, norm_type=norm_type)
    a, v = _clone(lists), v0.clone()
    kernels.novograd_step(a, v, fresh, **hyper)
    b = _clone(lists)
    _, per = kernels.norm(b[0], max_norm=norm_type == 0)
    norms = per if norm_type == 0 else _exact_sqrt(per)
    want_v = blend_second_moment(
        v0.clone(), norms, fresh, beta2=0.98, norm_type=norm_type, init_zero=init_zero
    )
    if norm_type == 2:  # the blend's own square root, exactly rounded as the kernel's
        raw = 0.98 * v0 * v0 + (1 - 0.98) * norms * norms
        want_v = torch.where(fresh, want_v, _exact_sqrt(raw))
    kernels.novograd(b, want_v, **NOVOGRAD_ARGS)
    assert v.dtype == v0.dtype and torch.equal(v, want_v.to(v.dtype))
    for k in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)), k


def test_novograd_step_refused_writes_nothing(device):
    """A call the kernel refuses (exp_avg of the wrong dtype) raises before anything is
    written: the second moments and params are as they were."""
    lists = _novograd_lists(device)
    lists[2] = [t.double() for t in lists[2]]
    start = _clone(lists)
    v = torch.rand(len(lists[0]), device=device) + 0.5
    v_start = v.clone()
    with pytest.raises(RuntimeError, match="novograd_step: exp_avg must be"):
        kernels.backend(device).novograd_step(
            lists, v, None, norm_type=2, init_zero=False, **NOVOGRAD_ARGS
        )
    assert torch.equal(v, v_start)
    for k in range(3):
        assert all(torch.equal(x, y) for x, y in zip(lists[k], start[k], strict=True))


def test_novograd_step_mixed_dtypes_write_back_each_split(device):
    """A group whose lists mix dtypes is one kernel call per dtype signature (kernels.dispatch):
    each call blends a slice of v, which comes back in place in the caller's order."""
    parts = [_novograd_lists(device, g, p) for g, p in
             [(torch.float32, torch.float32), (torch.float16, torch.float16)]]  # fmt: skip
    lists = [parts[0][k][:3] + parts[1][k][:3] for k in range(3)]
    n = len(lists[0])
    v0 = torch.rand(n, device=device) + 0.5
    v = v0.clone()
    kernels.novograd_step(_clone(lists), v, None, norm_type=2, init_zero=False, **NOVOGRAD_ARGS)
    for lo, hi in ((0, 3), (3, 6)):
        one = v0[lo:hi].clone()
        part = [lst[lo:hi] for lst in lists]
        kernels.novograd_step(
            _clone(part), one, None, norm_type=2, init_zero=False, **NOVOGRAD_ARGS
        )
        assert torch.equal(v[lo:hi], one)


@pytest.mark.parametrize("started", [False, True])
def test_sgd_device_first_run_flag_matches_host_flag(started, device):
    """first_run_t (a device flag, so a skipped first step needs no host sync) does what the host
    first_run does: buffer = grad on the first run, momentum * buffer + (1 - dampening) * grad
    after; dampening 0.5 makes the two rules differ."""
    shapes = _shapes(device)
    grads = make_tensors(shapes, torch.float32, device)
    results = []
    for flag in ("host", "device"):
        params = [torch.ones(s, device=device) for s in shapes]
        bufs = [torch.full(s, 0.25, device=device) for s in shapes]
        extra = (
            {"first_run": not started}
            if flag == "host"
            else {
                "first_run": started,  # ignored: the device flag wins
                "first_run_t": torch.tensor([0.0 if started else 1.0], device=device),
            }
        )
        kernels.sgd(
            [grads, params, bufs],
            lr=0.1,
            momentum=0.9,
            dampening=0.5,
            weight_decay=0.0,
            nesterov=False,
            wd_after_momentum=False,
            scale=1.0,
            **extra,
        )
        results.append((params, bufs))
    (hp, hb), (dp, db) = results
    for g, a, b, x, y in zip(grads, hp, dp, hb, db):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        expected = g if not started else 0.9 * 0.25 + 0.5 * g
        torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-7)
