"""``kernels.symmetric_bmm_add``: a product the caller knows is symmetric (``X Xᵀ``,
``b A + c A²``), on 16-bit CUDA stacks by its lower block rows and a mirror (Note: symmetric
products in csrc/linalg/bmm_add_cuda.cu); elsewhere torch's whole product bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_MARKS
from matmul_numerics import UNIT, gauss, relative

from shardopt import kernels
from shardopt.algorithms import muon
from shardopt.kernels import matmul

CUDA_MARK, CUDA_SKIP = CUDA_MARKS


def _band_of(n: int, bands: int) -> int:
    """The rows of a band, as the kernel cuts them: ceil(n / bands) rounded up to 8."""
    return (-(-n // bands) + 7) // 8 * 8


def _above_bands(n: int, h: int) -> torch.Tensor:
    """The (n, n) mask of entries above the diagonal blocks of h rows: those mirrored."""
    block = torch.arange(n) // h
    return block[:, None] < block[None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_is_torchs_whole_product_bit_for_bit(dtype):
    x = gauss(3, 40, 24).to(dtype)
    sym = torch.bmm(x, x.mT)
    assert torch.equal(kernels.symmetric_bmm_add(x, x.mT), torch.bmm(x, x.mT))
    assert torch.equal(kernels.symmetric_bmm_add(x, x.mT, alpha=-2.5), torch.bmm(x, x.mT) * -2.5)
    before = sym.clone()
    got = kernels.symmetric_bmm_add(sym, sym, sym, alpha=2.0315, beta=-4.775)
    assert torch.equal(got, torch.baddbmm(sym, sym, sym, beta=-4.775, alpha=2.0315))
    assert torch.equal(sym, before)


@pytest.mark.parametrize(
    "rows,n,bands",
    [(512, 1024, 2), (512, 1023, 1), (512, 2048, 4), (512, 8192, 4), (0, 4096, 1), (300, 900, 3)],
)
def test_bands_keep_the_fewest_rows(monkeypatch, rows, n, bands):
    monkeypatch.setattr(matmul, "SYMMETRIC_BAND_ROWS", rows)
    assert matmul.symmetric_bands(n) == bands


# (batch, n, q, bands): odd n (a short last band, a band height rounded up to 8), one matrix,
# more bands than fit (fewer are cut), Newton-Schulz's wide and square products
CASES = [(3, 200, 96, 3), (1, 37, 50, 2), (2, 130, 130, 5), (2, 96, 256, 40), (4, 256, 512, 4)]


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_gram_matches_fp64_and_torch(dtype, case, tall):
    """X Xᵀ (Xᵀ X of a tall stack, as Newton-Schulz's own layout takes it) by bands: within
    torch's own error of the exact product, exactly symmetric above the diagonal blocks."""
    k, n, q, bands = case
    x = (gauss(k, q, n) if tall else gauss(k, n, q)).to("cuda", dtype)
    a, b = (x.mT, x) if tall else (x, x.mT)
    got = kernels.extension().cuda.symmetric_bmm(a, b, 1.0, bands)
    ref = (x.double().mT @ x.double()) if tall else (x.double() @ x.double().mT)
    theirs = torch.bmm(a, b)
    assert got.shape == (k, n, n) and got.dtype == dtype and got.is_contiguous()
    assert relative(got, ref.cpu()) <= 1.5 * relative(theirs, ref.cpu())
    assert relative(got, ref.cpu()) <= UNIT[dtype]
    above = _above_bands(n, _band_of(n, bands)).cuda()
    assert torch.equal(got.mT[:, above], got[:, above])


@pytest.mark.parametrize("bands", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_square_with_addend(dtype, bands):
    """b A + c A² (Newton-Schulz's B) by bands against fp64 and torch's baddbmm; A only read."""
    x = gauss(3, 160, 400).to("cuda", dtype)
    sym = torch.bmm(x, x.mT) / 400
    before = sym.clone()
    got = kernels.extension().cuda.symmetric_bmm_add(sym, sym, sym, 2.0315, -4.775, bands)
    s64 = sym.double()
    ref = (-4.775 * s64 + 2.0315 * s64 @ s64).cpu()
    theirs = torch.baddbmm(sym, sym, sym, beta=-4.775, alpha=2.0315)
    assert torch.equal(sym, before)
    assert relative(got, ref) <= 1.5 * relative(theirs, ref)
    assert relative(got, ref) <= UNIT[dtype]


@CUDA_MARK
@CUDA_SKIP
def test_cuda_computes_only_the_lower_bands():
    """Given a product that is not symmetric, the entries above the diagonal blocks are the
    transposed lower ones (mirrored, never computed) and the rest is the product: the kernel
    does the promised half of the work, not the whole."""
    n, bands = 96, 3
    a, b = (gauss(2, n, 64, seed=s).to("cuda", torch.bfloat16) for s in (1, 2))
    got = kernels.extension().cuda.symmetric_bmm(a, b.mT, 1.0, bands)
    full = torch.bmm(a, b.mT)
    above = _above_bands(n, _band_of(n, bands)).cuda()
    assert torch.equal(got[:, above], got.mT[:, above])
    assert not torch.allclose(got[:, above], full[:, above], atol=1.0)
    kept = ~above
    assert relative(got[:, kept], full[:, kept].double().cpu()) <= UNIT[torch.bfloat16]


def test_bad_shapes_raise_on_every_device():
    x = gauss(2, 40, 24)
    with pytest.raises(
        ValueError, match=r"a \(2, 40, 24\) @ b \(2, 24, 30\) is not a batch of square"
    ):
        kernels.symmetric_bmm_add(x, x[:, :30].mT)
    with pytest.raises(ValueError, match=r"must be 3-D, got shapes \[\(40, 24\)"):
        kernels.symmetric_bmm_add(x[0], x.mT)
    sym = torch.bmm(x, x.mT)
    with pytest.raises(
        ValueError, match=r"c \(2, 40, 39\) must be the product's shape \(2, 40, 40\)"
    ):
        kernels.symmetric_bmm_add(x, x.mT, sym[..., :-1])


@CUDA_MARK
@CUDA_SKIP
def test_cuda_fp32_is_torch():
    x = gauss(2, 40, 24).to("cuda", torch.float32)
    assert torch.equal(kernels.symmetric_bmm_add(x, x.mT), torch.bmm(x, x.mT))
    sym = torch.bmm(x, x.mT)
    got = kernels.symmetric_bmm_add(sym, sym, sym, alpha=2.0, beta=-1.0)
    assert torch.equal(got, torch.baddbmm(sym, sym, sym, beta=-1.0, alpha=2.0))


# the extension's own checks (host-compiled, run by the bindings before the CUDA code: Note: checks
# before nvcc-built code), in a child process: a fault there fails this test, not the whole run
_EXTENSION_CHECKS = r"""
import torch
from shardopt import kernels
ext = kernels.extension().cuda
y = torch.randn(2, 40, 24, device="cuda", dtype=torch.bfloat16)
s = torch.bmm(y, y.mT)
cases = [
    (lambda: ext.symmetric_bmm(y, y[:, :30].mT, 1.0, 2),
     "must be square (symmetric), got a (2, 40, 24)"),
    (lambda: ext.symmetric_bmm(y, y.mT, 1.0, 0), "symmetric_bmm: blocks must be at least 1, got 0"),
    (lambda: ext.symmetric_bmm(y, y.mT[:, :-1], 1.0, 2),
     "shapes do not chain: a (2, 40, 24) @ b (2, 23"),
    (lambda: ext.symmetric_bmm(y, y.mT.half(), 1.0, 2), "one dtype"),
    (lambda: ext.symmetric_bmm_add(y, y.mT, s[:, :-1], 1.0, 1.0, 2), "+ c (2, 39, 40)"),
]
for call, message in cases:
    try:
        call()
    except RuntimeError as exc:
        assert message in str(exc), (message, str(exc))
    else:
        raise AssertionError(f"no error: {message}")
print("checked", len(cases))
"""


@CUDA_MARK
@CUDA_SKIP
def test_cuda_extension_checks_name_the_problem():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _EXTENSION_CHECKS], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "checked 5" in out.stdout, (out.returncode, out.stderr[-3000:])


@pytest.mark.parametrize("fn", ["newton_schulz", "gram_newton_schulz"])
@pytest.mark.parametrize("shape", [(2, 1024, 1536), (2, 1536, 1024)], ids=["wide", "tall"])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_newton_schulz_with_bands(monkeypatch, fn, shape):
    """Newton-Schulz with its symmetric products in bands (2 of 512 rows here) is as close to the
    exact map (fp64) as the same iteration with whole products, in bf16 (standard) and fp16
    (Gram, its precision), and within BF16_NS_TOL."""
    triples = [muon.DEFAULT_NS_COEFFICIENTS] * 5
    x64 = gauss(*shape)
    want = muon.newton_schulz(x64.clone(), triples, 1e-7)
    dtype = torch.float16 if fn == "gram_newton_schulz" else torch.bfloat16
    run = getattr(muon, fn)
    monkeypatch.setattr(matmul, "SYMMETRIC_BAND_ROWS", 512)
    banded = relative(run(x64.to("cuda", dtype), triples, 1e-7), want)
    monkeypatch.setattr(matmul, "SYMMETRIC_BAND_ROWS", 0)
    whole = relative(run(x64.to("cuda", dtype), triples, 1e-7), want)
    assert banded <= 1.25 * whole + 1e-3
    assert banded < 3e-2  # test_muon.BF16_NS_TOL
