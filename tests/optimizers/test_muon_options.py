"""FusedMuon's fused kernels and its options beyond torch.optim.Muon: the kernels against torch's
ops (bits) and the fp64 formulas on odd sizes and every dtype; Gram Newton-Schulz, the Polar
Express preset and ns_split against the fp64 reference (``ns_dtype=torch.float32``, 1e-4 of the
update's norm); capturable (a tensor lr read on the device, a CUDA graph) and torch.compile."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from test_muon import BF16_NS_TOL, FP32_NS_TOL, STEPS, _grads, _params, _rel, _run

from shardopt import FusedMuon, reference
from shardopt.algorithms import muon

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
IDS = ["fp32", "bf16", "fp16", "fp64"]
# one element, a tensor crossing the CPU chunk (16384) and CUDA vector boundaries, many tiny ones
SIZES = {"one": [(1,)], "odd": [(278011,)], "tiny": [(3,)] * 40 + [(16385,)]}


def _on(shapes, dtype, device, scale=1.0):
    return [(torch.randn(s, dtype=torch.float64) * scale).to(device, dtype) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["ns-bf16", "ns-fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_momentum_kernel_is_torchs_lerp(dtype, ns_dtype, nesterov, size, device):
    """Bit for bit torch.optim.Muon's buf.lerp_(g, 1 - μ) and g.lerp(buf, μ).to(ns_dtype)
    (CPU; on CUDA within one rounding of each), and within rounding of the fp64 formula."""
    shapes = SIZES[size]
    grads, bufs = _on(shapes, dtype, device), _on(shapes, dtype, device)
    want_bufs = [b.clone().lerp_(g, 1 - 0.95) for b, g in zip(bufs, grads)]
    want = [g.lerp(b, 0.95) if nesterov else b for g, b in zip(grads, want_bufs)]
    mixes = [torch.empty(s, dtype=ns_dtype, device=device) for s in shapes]
    fp64 = [0.95 * b.double() + 0.05 * g.double() for b, g in zip(bufs, grads)]
    muon.momentum_and_mix(grads, bufs, mixes, 0.95, nesterov)
    ulp = torch.finfo(dtype).eps
    for b, wb, m, w, f, g in zip(bufs, want_bufs, mixes, want, fp64, grads):
        if device == "cpu":
            assert torch.equal(b, wb) and torch.equal(m, w.to(ns_dtype))
        else:
            torch.testing.assert_close(b, wb, rtol=ulp, atol=ulp)
            torch.testing.assert_close(m, w.to(ns_dtype), rtol=2 * ulp, atol=2 * ulp)
        torch.testing.assert_close(b.double(), f, rtol=2 * ulp, atol=2 * ulp)
        mix64 = 0.05 * g.double() + 0.95 * f if nesterov else f
        tol = 2 * max(ulp, torch.finfo(ns_dtype).eps)
        torch.testing.assert_close(m.double(), mix64, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["ns-bf16", "ns-fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_apply_kernel_is_torchs_mul_and_add(dtype, ns_dtype, size, device):
    """p.mul_(1 - lr·wd); p.add_(u, alpha=-lr·s) bit for bit on the CPU (see Note: Muon's apply
    on 16-bit CPU params), within a rounding on CUDA, and of the fp64 formula."""
    shapes = SIZES[size]
    params, updates = _on(shapes, dtype, device), _on(shapes, ns_dtype, device, 0.3)
    lr, wd, ratio = 0.02, 0.1, 1.7
    want = [p.clone().mul_(1 - lr * wd).add_(u, alpha=-lr * ratio) for p, u in zip(params, updates)]
    fp64 = [p.double() * (1 - lr * wd) - lr * ratio * u.double() for p, u in zip(params, updates)]
    start = [p.clone() for p in params]
    muon.decay_and_apply(params, updates, None, lr, wd, ratio)
    ulp = torch.finfo(dtype).eps
    for p, w in zip(params, want):
        if device == "cpu":
            assert torch.equal(p, w)
        else:
            torch.testing.assert_close(p, w, rtol=ulp, atol=ulp * 1e-2)
    for p, f, s, u in zip(params, fp64, start, updates):  # two roundings: of p·decay, of the sum
        bound = 2 * ulp * (s.double().abs() + (lr * ratio * u.double()).abs()) + 1e-300
        assert ((p.double() - f).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_apply_kernel_writes_the_rounded_master(out_dtype, device):
    shapes = SIZES["tiny"] + SIZES["odd"]
    masters = _on(shapes, torch.float32, device)
    outs = [torch.empty(s, dtype=out_dtype, device=device) for s in shapes]
    updates = _on(shapes, torch.bfloat16, device)
    want = [m.clone().mul_(1 - 0.002).add_(u, alpha=-0.03) for m, u in zip(masters, updates)]
    muon.decay_and_apply(masters, updates, outs, 0.02, 0.1, 1.5)
    for m, o, w in zip(masters, outs, want):
        if device == "cpu":
            assert torch.equal(m, w)
        torch.testing.assert_close(m, w, rtol=1e-6, atol=1e-7)
        assert torch.equal(o, m.to(out_dtype))


def _vs_reference(device, options, shapes, steps=STEPS, tol=FP32_NS_TOL):
    params = _params(shapes, torch.float32, device)
    start = [p.detach().clone() for p in params]
    options = {"lr": 0.02, **options}
    opt = FusedMuon(params, ns_dtype=torch.float32, **options)
    ref = reference.Muon(start, **options)
    for _ in range(steps):
        grads = _grads(shapes, torch.float32, device)
        _run(opt, params, grads)
        ref.step(grads)
        for p, r, s in zip(params, ref.params(), start):
            assert _rel(p, r, s) < tol


GRAM_SHAPES = [(8, 40), (40, 8), (16, 16), (3, 6, 30), (24, 48), (24, 48)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(), id="defaults"),
        pytest.param(dict(ns_coefficients="polar_express"), id="polar-express"),
        pytest.param(dict(ns_steps=8, nesterov=False), id="8-steps"),
        pytest.param(dict(ns_steps=2), id="2-steps"),
    ],
)
def test_gram_newton_schulz_matches_reference(options, device):
    _vs_reference(device, dict(ns_algorithm="gram", **options), GRAM_SHAPES)


@pytest.mark.parametrize("fn", ["newton_schulz", "gram_newton_schulz"])
def test_tall_stacks_run_in_their_own_layout(fn):
    """A tall stack's result is the wide transpose's, transposed (fp64: to 1e-12), and comes
    back contiguous in the stack's layout (no transposed copy for the apply kernel)."""
    wide = torch.randn(3, 12, 40, dtype=torch.float64)
    triples = [muon.DEFAULT_NS_COEFFICIENTS] * 5
    want = getattr(muon, fn)(wide.clone(), triples, 1e-7)
    got = getattr(muon, fn)(wide.mT.contiguous(), triples, 1e-7)
    assert got.is_contiguous() and got.shape == (3, 40, 12)
    torch.testing.assert_close(got, want.mT, rtol=1e-12, atol=1e-12)


def test_gram_is_the_standard_iteration_in_fp64():
    x = torch.randn(4, 12, 50, dtype=torch.float64)
    triples = muon.coefficient_triples("polar_express", 5)
    want = muon.newton_schulz(x.clone(), triples, 1e-7)
    got = muon.gram_newton_schulz(x.clone(), triples, 1e-7)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    tall = x.mT.contiguous()
    torch.testing.assert_close(
        muon.gram_newton_schulz(tall.clone(), triples, 1e-7), want.mT, rtol=1e-10, atol=1e-10
    )


def _spectrum(kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A (1, rows, cols) fp64 matrix: Gaussian, or singular values spread from 1 to 1e-3
    (a momentum matrix's spectrum decays; Newton-Schulz leaves its small values least settled)."""
    if kind == "gauss":
        return torch.randn(1, rows, cols, dtype=torch.float64, generator=gen)
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=gen))[0]
    return ((u * torch.logspace(0, -3, k, dtype=torch.float64)) @ v.T)[None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gauss", "decay"])
@pytest.mark.parametrize("shape", [(96, 384), (384, 96)], ids=["wide", "tall"])
def test_gram_precision_in_bf16_and_fp16(shape, kind, device):
    """Gram Newton-Schulz's distance from the exact map (fp64 standard iteration) against the
    standard iteration's: in bf16 up to about twice it (CPU; about 1.05x on an H100), within
    BF16_NS_TOL on Gaussian matrices; in fp16,
    where Gram keeps the spec's accuracy, under half of torch's bf16 standard one.
    The numbers behind these bounds are in docs/spec.md (Gram Newton-Schulz)."""
    x = _spectrum(kind, *shape, torch.Generator().manual_seed(0))
    triples = [muon.DEFAULT_NS_COEFFICIENTS] * 5
    want = muon.newton_schulz(x.clone(), triples, 1e-7)

    def err(fn, dtype):
        got = fn(x.to(device, dtype), triples, 1e-7).double().cpu()
        return ((got - want).norm() / want.norm()).item()

    std16, gram16 = (
        err(muon.newton_schulz, torch.bfloat16),
        err(muon.gram_newton_schulz, torch.bfloat16),
    )
    gram_fp16 = err(muon.gram_newton_schulz, torch.float16)
    assert gram16 < 2.5 * std16  # bf16 Gram: a coarser rounding of the same map, at most
    assert gram_fp16 < 0.5 * std16  # fp16 Gram: closer to the exact map than torch's bf16
    if kind == "gauss":
        assert std16 < BF16_NS_TOL and gram16 < BF16_NS_TOL and gram_fp16 < 0.1 * BF16_NS_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_polar_express_preset_is_its_triples(device):
    _vs_reference(device, dict(ns_coefficients="polar_express"), [(8, 16), (16, 8)])
    triples = muon.coefficient_triples("polar_express", 7)
    assert triples[:5] == list(muon.NS_PRESETS["polar_express"]) and triples[5:] == [triples[4]] * 2
    with pytest.raises(ValueError, match="preset"):
        FusedMuon([torch.nn.Parameter(torch.randn(4, 4))], ns_coefficients="polar")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "split, shapes",
    [
        pytest.param(8, [(24, 16), (24, 16), (2, 24, 16)], id="per-head"),
        pytest.param((16, 4, 4), [(24, 16), (2, 24, 16)], id="q-k-v"),
        pytest.param((12, 12), [(24, 8)], id="gate-up"),
    ],
)
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_ns_split_matches_reference(split, shapes, adjust_lr_fn, device):
    _vs_reference(device, dict(ns_split=split, adjust_lr_fn=adjust_lr_fn), shapes)


def test_ns_split_with_gram_and_masters():
    shapes = [(24, 16), (2, 24, 64)]
    _vs_reference("cpu", dict(ns_split=(16, 4, 4), ns_algorithm="gram"), shapes)
    params = _params(shapes, torch.bfloat16, "cpu", 0.1)
    opt = FusedMuon(params, lr=0.2, ns_split=8, master_weights=True, ns_dtype=torch.float32)
    _run(opt, params, _grads(shapes, torch.bfloat16, "cpu"))
    for p in params:
        assert torch.equal(p, opt.state[p]["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("split", [5, (20, 5), 0])
def test_bad_split_raises_at_construction(split):
    with pytest.raises(ValueError, match="ns_split"):
        FusedMuon([torch.nn.Parameter(torch.randn(24, 16))], ns_split=split)
    with pytest.raises(ValueError, match="ns_algorithm"):
        FusedMuon([torch.nn.Parameter(torch.randn(4, 4))], ns_algorithm="fast")


@pytest.mark.parametrize("device", DEVICES)
def test_capturable_with_a_tensor_lr_is_the_plain_step(device):
    shapes = [(8, 16), (16, 8), (3, 4, 4)]
    params = _params(shapes, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(0.02, device=device)
    opts = [FusedMuon(params, lr=lr, capturable=True), FusedMuon(twins, lr=0.02)]
    for _ in range(STEPS):
        grads = _grads(shapes, torch.float32, device)
        _run(opts[0], params, grads)
        _run(opts[1], twins, grads)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert "step" not in opts[0].state_dict()["param_groups"][0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_a_captured_step_replays_as_eager(ns_algorithm):
    shapes = [(64, 256), (256, 64), (4, 32, 32)]
    start = _grads(shapes, torch.float32, "cuda")
    graphed = [torch.nn.Parameter(t.clone()) for t in start]
    eager = [torch.nn.Parameter(t.clone()) for t in start]
    kw = dict(lr=torch.tensor(0.02, device="cuda"), ns_algorithm=ns_algorithm)
    opts = [FusedMuon(graphed, capturable=True, **kw), FusedMuon(eager, capturable=True, **kw)]
    grads = [_grads(shapes, torch.float32, "cuda") for _ in range(6)]
    for p, g in zip(graphed, grads[0]):
        p.grad = g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            for p, g in zip(graphed, grads[k]):
                p.grad.copy_(g)
            opts[0].step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opts[0].step()
    for k in range(6):
        _run(opts[1], eager, grads[k])
        if k >= 3:
            for p, g in zip(graphed, grads[k]):
                p.grad.copy_(g)
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(graphed, eager):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "options", [dict(), dict(ns_algorithm="gram", ns_split=4)], ids=["std", "gram-split"]
)
def test_step_compiles_fullgraph(options, ns_dtype, device):
    """The compiled step has no graph break and computes the eager step's update.

    Bits agree to 1e-6 where the matmuls do: on the CPU, and with fp32 Newton-Schulz. bf16
    Newton-Schulz on CUDA is held to the bound of two valid bf16 orderings (BF16_NS_TOL of the
    update's norm, docs/spec.md; Gram's too, its bf16 rounding on CUDA about the standard one's):
    cuBLAS may pick another kernel, and so another order of the bf16 sums, for the traced
    graph's tensors than for the eager views. That bound is one step's, from one start, on
    blocks big enough for the sums to average (16 x 128 and 16 x 64 there; blocks of 2 or 4 rows
    stray up to 6%): the twins restart from the compiled params each step, so the drift of
    earlier steps is not counted against this one.
    """
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    ordered = device == "cuda" and ns_dtype == torch.bfloat16
    shapes = [(64, 128), (128, 64), (64, 128)] if ordered else [(8, 16), (16, 8), (8, 16)]
    params = _params(shapes, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.02, ns_dtype=ns_dtype, **options)
    if ordered and "ns_split" in kw:
        kw["ns_split"] = 16
    opts = [FusedMuon(params, **kw), FusedMuon(twins, **kw)]
    compiled = torch.compile(lambda opt: opt.step(), fullgraph=True, backend="aot_eager")
    for _ in range(STEPS):
        grads = _grads(shapes, torch.float32, device)
        if ordered:  # one step from one start (momentum depends on the grads alone)
            with torch.no_grad():
                for p, q in zip(params, twins):
                    q.copy_(p)
        before = [q.detach().clone() for q in twins]
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        compiled(opts[0])
        opts[1].step()
        for p, q, b in zip(params, twins, before):
            if ordered:
                assert _rel(p, q, b) < BF16_NS_TOL
            else:
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
