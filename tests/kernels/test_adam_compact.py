"""_compact_ops.adam_compact: Adam over compact state (docs/spec.md "Compact state formats").

Every (grad dtype, master mode, state format) against the fp64 reference run on the state the
kernel decodes (state_codec), bit parity with ``_ops.adam`` for fp32 state, skipped steps, device
scalars, unaligned views, thread counts and bad input. The codec inside the kernels:
tests/kernels/test_state_codec_kernels.py.
"""

import pytest
import torch
from compact_state import HYPER, Compact, make_grads
from conftest import TOLERANCES

from shardopt import kernels as _ops
from shardopt import reference
from shardopt import state_codec as sc
from shardopt.kernels import compact as _compact_ops

GRADS = [
    pytest.param(torch.float32, id="g32"),
    pytest.param(torch.bfloat16, id="gbf16"),
    pytest.param(torch.float16, id="g16"),
]
MASTERS = ["fp32", "bf16+rem", "bf16", "fp16"]
SIZES = [1, 255, 257, 3 * 256 + 17, 1000]
OPTIONS = [
    pytest.param({}, id="adamw"),
    pytest.param(dict(adam_w_mode=False, weight_decay=0.1), id="l2"),
    pytest.param(dict(bias_correction=False, beta1=0.8, beta2=0.95, eps=1e-6), id="no-bc"),
]
FP32_TOL = TOLERANCES[torch.float32]


def _assert_step_matches_reference(state, grads, hyper, step):
    """One kernel step against reference.adam_update in fp64 from the state the kernel decodes.

    Compact moments may differ from the reference by one code step, plus the fp32 rounding of the
    moment update's terms (a small m from the cancellation of large terms is only that exact).
    """
    masters, (ms, vs) = state.masters(), state.moments()
    b1, b2, wd = hyper["beta1"], hyper["beta2"], hyper["weight_decay"]
    bc = hyper["bias_correction"]
    want = []
    for p, g, m, v in zip(masters, grads, ms, vs):
        p, g, m, v = p.double(), g.double(), m.double(), v.double()
        g_eff = g if hyper["adam_w_mode"] else g + wd * p
        slack = (b1 * m.abs() + (1 - b1) * g_eff.abs(), b2 * v + (1 - b2) * g_eff * g_eff)
        reference.adam_update(
            p,
            g,
            m,
            v,
            lr=hyper["lr"],
            beta1=b1,
            beta2=b2,
            eps=hyper["eps"],
            weight_decay=wd,
            adam_w_mode=hyper["adam_w_mode"],
            bc1=1 - b1**step if bc else 1.0,
            bc2=1 - b2**step if bc else 1.0,
        )
        want.append((p, m, v, slack))
    _compact_ops.adam_compact(state.lists(grads), step=step, state_format=state.fmt, **hyper)
    got_p = state.masters()
    got_m, got_v = state.moments()
    step_m, step_v = state.steps()
    for i, (p, m, v, slack) in enumerate(want):
        if state.master_mode in ("fp32", "bf16+rem"):
            torch.testing.assert_close(got_p[i].double(), p, rtol=FP32_TOL[0], atol=FP32_TOL[1])
        else:
            rtol, atol = TOLERANCES[state.params[i].dtype]
            torch.testing.assert_close(got_p[i].double(), p, rtol=rtol, atol=atol)
        for got, ref, allowed, terms in (
            (got_m[i], m, step_m[i], slack[0]),
            (got_v[i], v, step_v[i], slack[1]),
        ):
            if state.fmt == "fp32":
                torch.testing.assert_close(got.double(), ref, rtol=FP32_TOL[0], atol=FP32_TOL[1])
            else:
                err = (got.double() - ref).abs()
                bound = allowed.double() + 2.4e-7 * terms + 1e-30
                assert (err <= bound).all(), f"tensor {i}: {(err - bound).max().item()} over"
    return got_p


@pytest.mark.parametrize("fmt", sc.FORMATS)
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("grad_dtype", GRADS)
def test_every_combination_matches_the_reference(grad_dtype, master, fmt, device):
    state = Compact(SIZES, master, fmt, device)
    before = [p.clone() for p in state.masters()]
    for step in range(1, 4):
        grads = make_grads(SIZES, grad_dtype, device, seed=step)
        _assert_step_matches_reference(state, grads, HYPER, step)
    assert any(not torch.equal(a, b) for a, b in zip(before, state.masters()))


@pytest.mark.parametrize("fmt", sc.FORMATS)
@pytest.mark.parametrize("options", OPTIONS)
def test_options_match_the_reference(options, fmt, device):
    hyper = dict(HYPER, **options)
    sizes = [_ops.chunk_size(device) + 300, 7]  # a tensor crossing a work-item boundary
    state = Compact(sizes, "bf16+rem", fmt, device)
    for step in range(1, 3):
        grads = make_grads(sizes, torch.float32, device, seed=step)
        _assert_step_matches_reference(state, grads, hyper, step)


REGIME = dict(
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    adam_w_mode=True,
    bias_correction=True,
    weight_decay=0.0,
)
REGIME_SIZES = [1000, 300]


def _regime_grads(sizes, small, step, device):
    """Step 1: grads ``small`` with 1.0 at every 97th element (several blocks hold one), then
    zero grads (unused embedding rows, masked features, dead units)."""
    grads = []
    for n in sizes:
        g = torch.full((n,), small if step == 1 else 0.0)
        if step == 1:
            g[::97] = 1.0
        grads.append(g.to(device))
    return grads


def _regime_movement(master, fmt, small, device, steps=10):
    """How far each param moves from 0 over the regime: the kernel (``fmt``) or, for
    ``fmt=None``, the fp64 reference (fp32-state Adam without rounding)."""
    if fmt is None:
        ps = [torch.zeros(n, dtype=torch.float64) for n in REGIME_SIZES]
        ms = [torch.zeros_like(p) for p in ps]
        vs = [torch.zeros_like(p) for p in ps]
        h = REGIME
        for step in range(1, steps + 1):
            for p, g, m, v in zip(ps, _regime_grads(REGIME_SIZES, small, step, "cpu"), ms, vs):
                reference.adam_update(
                    p, g.double(), m, v, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                    eps=h["eps"], weight_decay=0.0, adam_w_mode=True,
                    bc1=1 - h["beta1"] ** step, bc2=1 - h["beta2"] ** step,
                )  # fmt: skip
        return [p.abs() for p in ps]
    state = Compact(REGIME_SIZES, master, fmt, device).zero()
    for step in range(1, steps + 1):
        grads = _regime_grads(REGIME_SIZES, small, step, device)
        _compact_ops.adam_compact(state.lists(grads), step=step, state_format=fmt, **REGIME)
    return [p.double().abs().cpu() for p in state.masters()]


@pytest.mark.parametrize("small", [1e-3, 1e-4, 1e-5])
@pytest.mark.parametrize("fmt", sc.FORMATS)
@pytest.mark.parametrize("master", MASTERS)
def test_zero_grads_after_small_grads_move_as_fp32_state(master, fmt, small, device):
    """One step of small grads (1.0 here and there), then 9 zero-grad steps at lr 1e-3: every
    format moves every param within a factor 2 of fp32-state Adam (v kept as v in fp16 or int8
    underflowed where m did not: the update became m / eps, 158.7 instead of 0.0042)."""
    want = _regime_movement(master, None, small, device)
    got = _regime_movement(master, fmt, small, device)
    for i, (w, g) in enumerate(zip(want, got)):
        ratio = g / w
        assert (w > 1e-3).all()
        assert (ratio >= 0.5).all() and (ratio <= 2.0).all(), (
            f"tensor {i}: moved {g.min().item():.3g}..{g.max().item():.3g}, fp32 state "
            f"{w.min().item():.3g}..{w.max().item():.3g}"
        )


@pytest.mark.parametrize("grad_dtype", GRADS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fp32_state_with_remainders_is_bit_identical_to_adam_with_a_bf16_out(
    grad_dtype, adam_w_mode, device
):
    sizes = [1, 1000, _ops.chunk_size(device) + 37]
    compact = Compact(sizes, "bf16+rem", "fp32", device)
    masters = [x.clone() for x in compact.masters()]
    exp_avg = [m.clone() for m in compact.exp_avg]
    exp_avg_sq = [v.clone() for v in compact.exp_avg_sq]
    outs = [torch.empty_like(x, dtype=torch.bfloat16) for x in masters]
    hyper = dict(HYPER, adam_w_mode=adam_w_mode, weight_decay=0.05)
    lr_t = torch.tensor([hyper.pop("lr")], device=device)
    scale_t = torch.tensor([0.75], device=device)
    ties = 0
    for step in range(1, 41):
        grads = make_grads(sizes, grad_dtype, device, seed=step)
        step_t = torch.tensor([float(step)], device=device)
        scalars = dict(lr=0.0, step=0, lr_t=lr_t, step_t=step_t, grad_scale_t=scale_t, **hyper)
        _ops.adam([grads, masters, exp_avg, exp_avg_sq, outs], **scalars)
        _compact_ops.adam_compact(compact.lists(grads), state_format="fp32", **scalars)
        for i, master in enumerate(masters):
            assert torch.equal(compact.masters()[i].view(torch.int32), master.view(torch.int32))
            assert torch.equal(compact.exp_avg[i], exp_avg[i])
            assert torch.equal(compact.exp_avg_sq[i], exp_avg_sq[i])
            tie = compact.remainders[i] == -0x8000
            p_bits, out_bits = compact.params[i].view(torch.int16), outs[i].view(torch.int16)
            assert torch.equal(p_bits[~tie], out_bits[~tie])
            # a tie rounds away from zero, RNE to even: they differ when the param is odd
            assert ((p_bits[tie] - out_bits[tie]) == (p_bits[tie] & 1)).all()
            ties += int(tie.sum())
    assert ties > 0


@pytest.mark.parametrize(
    "master, grad_dtype",
    [
        ("fp32", torch.float32),
        ("fp32", torch.float16),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
    ],
)
def test_fp32_state_is_bit_identical_to_adam(master, grad_dtype, device):
    sizes = [300, _ops.chunk_size(device) + 5]
    compact = Compact(sizes, master, "fp32", device)
    params = [p.clone() for p in compact.params]
    exp_avg = [m.clone() for m in compact.exp_avg]
    exp_avg_sq = [v.clone() for v in compact.exp_avg_sq]
    for step in range(1, 6):
        grads = make_grads(sizes, grad_dtype, device, seed=step)
        _ops.adam([grads, params, exp_avg, exp_avg_sq], step=step, **HYPER)
        _compact_ops.adam_compact(compact.lists(grads), step=step, state_format="fp32", **HYPER)
    for got, want in zip(
        compact.params + compact.exp_avg + compact.exp_avg_sq, params + exp_avg + exp_avg_sq
    ):
        assert torch.equal(got, want)


def _div(a, b):  # correctly rounded fp32 division (fp64 has enough bits to round once)
    return (a.double() / b.double()).float()


def _sqrt(x):  # correctly rounded fp32 square root (torch's CPU float32 sqrt is not)
    return torch.sqrt(x.double()).float()


def _fp32_step(state, grads, hyper, step):
    """One step of the blockwise formats from correctly rounded fp32 operations on the CPU, in
    adam_math.h's order, encoded by state_codec: what the CPU and CUDA kernels must give, bit for
    bit."""

    def f(x):
        return torch.tensor(x, dtype=torch.float32)

    b1, b2, eps = f(hyper["beta1"]), f(hyper["beta2"]), f(hyper["eps"])
    lr, wd = f(hyper["lr"]), f(hyper["weight_decay"])
    bc = hyper["bias_correction"]
    bc1 = f(1 - hyper["beta1"] ** step if bc else 1.0)
    bc2 = f(1 - hyper["beta2"] ** step if bc else 1.0)
    ms, vs = state.moments()
    want = []
    for p, g, m, v in zip(state.masters(), grads, ms, vs):
        p, g, m, v = p.cpu(), g.cpu().float(), m.cpu(), v.cpu()
        if not hyper["adam_w_mode"]:
            g = g + wd * p
        m = b1 * m + (f(1.0) - b1) * g
        v = b2 * v + (f(1.0) - b2) * g * g
        u = _div(_div(m, bc1), _sqrt(_div(v, bc2)) + eps)
        if hyper["adam_w_mode"]:
            u = u + wd * p
        p = p - lr * u
        if state.master_mode == "bf16+rem":
            params = list(sc.split_master(p))
        elif state.master_mode == "fp32":
            params = [p]
        else:
            params = [p.to(torch.bfloat16 if state.master_mode == "bf16" else torch.float16)]
        codes = sc.encode(m, state.fmt, signed=True) + sc.encode(v, state.fmt, signed=False)
        want.append(params + list(codes))
    return want


@pytest.mark.parametrize("fmt", ["scaled_fp16", "int8"])
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("options", OPTIONS)
def test_blockwise_is_bit_identical_to_fp32_operations(options, master, fmt, device):
    """The kernels' Adam math (on CUDA its own division and square-root sequences where the operands
    allow, adam_blockwise_cuda.cu) gives the bits of one rounded fp32 operation per step, over
    moments from 1e-30 to 1e10, zeros and partial blocks."""
    hyper = dict(HYPER, **options)
    sizes = [1, 255, 257, 3 * 256 + 17, _ops.chunk_size(device) + 300, 1000]
    state = Compact(sizes, master, fmt, device)
    zero_m = 127 if fmt == "int8" else 0
    state.exp_avg[-1][:300] = zero_m  # zero moments and zero grads: zero operands
    state.exp_avg_sq[-1][:300] = 0
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 4):
        grads = []
        for n in sizes:
            decades = torch.randint(-30, 10, (sc.num_blocks(n),), generator=gen).double()
            scale = (10.0**decades).float().repeat_interleave(sc.BLOCK)[:n]
            g = torch.randn(n, generator=gen) * scale
            g[::7] = 0.0
            grads.append(g.to(torch.bfloat16 if step == 2 else torch.float32).to(device))
        grads[-1][:300] = 0.0
        want = _fp32_step(state, grads, hyper, step)
        _compact_ops.adam_compact(state.lists(grads), step=step, state_format=fmt, **hyper)
        for i, expected in enumerate(want):
            got = [state.params[i]] + ([state.remainders[i]] if state.remainders else [])
            got += [state.exp_avg[i], state.exp_avg_scales[i]]
            got += [state.exp_avg_sq[i], state.exp_avg_sq_scales[i]]
            x, y = got[0].cpu(), expected[0]
            if x.dtype in (torch.bfloat16, torch.float16):  # a NaN param's payload may differ
                assert torch.equal(x.isnan(), y.isnan()), (i, step)
                x, y = x[~x.isnan()], y[~y.isnan()]
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (i, step)
            for x, y in zip(got[1:], expected[1:]):
                assert torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)), (i, step)


@pytest.mark.parametrize("fmt", sc.FORMATS)
@pytest.mark.parametrize("master", MASTERS)
def test_found_inf_changes_nothing(master, fmt, device):
    state = Compact(SIZES, master, fmt, device)
    before = state.snapshot()
    grads = make_grads(SIZES, torch.float32, device, 1)
    found_inf = torch.ones(1, device=device)
    _compact_ops.adam_compact(
        state.lists(grads), step=1, state_format=fmt, found_inf_t=found_inf, **HYPER
    )
    for a, b in zip(before, state.snapshot()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", sc.FORMATS)
def test_device_scalars_equal_host_values(fmt, device):
    a = Compact(SIZES, "bf16+rem", fmt, device)
    b = Compact(SIZES, "bf16+rem", fmt, device)
    grads = make_grads(SIZES, torch.float32, device, 1)
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    _compact_ops.adam_compact(
        a.lists([g * 0.5 for g in grads]), lr=0.02, step=3, state_format=fmt, **hyper
    )
    _compact_ops.adam_compact(
        b.lists(grads),
        lr=9.0,
        step=99,
        state_format=fmt,
        lr_t=torch.tensor([0.02], device=device),
        step_t=torch.tensor([3.0], device=device),
        grad_scale_t=torch.tensor([0.5], device=device),
        found_inf_t=torch.zeros(1, device=device),
        **hyper,
    )
    for x, y in zip(a.snapshot(), b.snapshot()):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("fmt", sc.FORMATS)
def test_unaligned_views_give_the_bits_of_aligned_tensors(fmt, device):
    """Tensors at an odd storage offset (flat shards of a bigger buffer) take the kernels' unaligned
    paths (CUDA: scalar accesses instead of 16-byte ones) with the same results."""
    sizes = [1000, 3 * 256 + 17]
    aligned = Compact(sizes, "bf16+rem", fmt, device)
    shifted = Compact(sizes, "bf16+rem", fmt, device)

    def offset(t):
        view = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)[1:]
        return view.copy_(t)

    for name in ("params", "remainders", "exp_avg", "exp_avg_sq"):
        setattr(shifted, name, [offset(t) for t in getattr(shifted, name)])
    grads = make_grads(sizes, torch.bfloat16, device, 1)
    _compact_ops.adam_compact(aligned.lists(grads), step=1, state_format=fmt, **HYPER)
    _compact_ops.adam_compact(
        shifted.lists([offset(g) for g in grads]), step=1, state_format=fmt, **HYPER
    )
    for x, y in zip(aligned.snapshot(), shifted.snapshot()):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["scaled_fp16", "int8"])
def test_blockwise_is_deterministic_across_thread_counts(fmt):
    sizes = [3 * _ops.chunk_size("cpu") + 100, 5]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            state = Compact(sizes, "bf16+rem", fmt, torch.device("cpu"))
            _compact_ops.adam_compact(
                state.lists(make_grads(sizes, torch.float32, "cpu", 1)),
                step=1,
                state_format=fmt,
                **HYPER,
            )
            results.append(state.snapshot())
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*results):
        assert torch.equal(x, y)


def _bad_lists():
    def lists(**change):
        base = dict(
            grads=[torch.zeros(300)],
            params=[torch.ones(300)],
            remainders=[],
            exp_avg=[torch.zeros(300, dtype=torch.uint8)],
            exp_avg_sq=[torch.zeros(300, dtype=torch.uint8)],
            exp_avg_scales=[torch.zeros(2)],
            exp_avg_sq_scales=[torch.zeros(2)],
        )
        base.update(change)
        return list(base.values())

    bf16 = torch.ones(300, dtype=torch.bfloat16)
    rem = torch.zeros(300, dtype=torch.int16)
    return [
        (lists()[:6], "int8", ValueError, "expected 7 tensor lists"),
        (lists(), "int4", ValueError, "unknown state format 'int4'"),
        (lists(), "scaled_fp16", TypeError, "tensor 0 of exp_avg is torch.uint8"),
        (
            lists(exp_avg=[torch.zeros(300)], exp_avg_sq=[torch.zeros(300)]),
            "fp32",
            ValueError,
            "has no scales",
        ),
        (
            lists(exp_avg_scales=[torch.zeros(3)]),
            "int8",
            RuntimeError,
            "exp_avg_scales .* must be a contiguous float32 tensor of 2 elements",
        ),
        (
            lists(exp_avg_sq_scales=[torch.zeros(2, dtype=torch.float16)]),
            "int8",
            RuntimeError,
            "exp_avg_sq_scales .* float32",
        ),
        (
            lists(exp_avg_scales=[], exp_avg_sq_scales=[]),
            "int8",
            RuntimeError,
            "exp_avg_scales has 0 tensors, expected one per param",
        ),
        (lists(remainders=[rem]), "int8", RuntimeError, "remainders go with bf16 params"),
        (
            lists(params=[bf16], remainders=[rem.int()]),
            "int8",
            RuntimeError,
            "remainders must be Short",
        ),
        (
            lists(params=[bf16], remainders=[rem, rem]),
            "int8",
            RuntimeError,
            "remainders has 2 tensors",
        ),
        (
            lists(grads=[torch.zeros(300, dtype=torch.float64)]),
            "int8",
            RuntimeError,
            "grads must be Float, Half or BFloat16",
        ),
        (
            lists(params=[torch.ones(300, dtype=torch.float64)]),
            "int8",
            RuntimeError,
            "params must be Float",
        ),
        (
            lists(
                grads=[torch.zeros(513)],
                params=[torch.ones(513)],
                exp_avg=[torch.zeros(513, dtype=torch.uint8)],
                exp_avg_sq=[torch.zeros(513, dtype=torch.uint8)],
            ),
            "int8",
            RuntimeError,
            "exp_avg_scales .* must be a contiguous float32 tensor of 3 elements",
        ),
        (
            lists(params=[torch.ones(299)]),
            "int8",
            RuntimeError,
            "tensor 0 of params .* has 299 elements",
        ),
        (lists(params=[torch.ones(600)[::2]]), "int8", RuntimeError, "is not contiguous"),
        (
            lists(grads=[torch.zeros(300), torch.zeros(3)]),
            "int8",
            RuntimeError,
            "params has 1 tensors, grads has 2",
        ),
    ]


@pytest.mark.parametrize("lists, fmt, error, match", _bad_lists())
def test_bad_input_raises(lists, fmt, error, match):
    hyper = dict(HYPER, step=1)
    with pytest.raises(error, match=match):
        _compact_ops.adam_compact(lists, state_format=fmt, **hyper)


def test_kernel_checks_exp_avg_sq_dtype():
    z = torch.zeros(4)
    lists = [[z], [z.clone()], [], [z.bfloat16()], [z.half()], [], []]
    with pytest.raises(RuntimeError, match="exp_avg_sq must have exp_avg's dtype"):
        _ops.cpu_extension().cpu.adam_compact(lists, 0.1, 0.9, 0.99, 1e-8, 1, True, True, 0.0)
    lists[5:] = [[torch.zeros(1)], [torch.zeros(1)]]
    with pytest.raises(RuntimeError, match="exp_avg must be Half or Byte"):
        _ops.cpu_extension().cpu.adam_blockwise(lists, 0.1, 0.9, 0.99, 1e-8, 1, True, True, 0.0)
