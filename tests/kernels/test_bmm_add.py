"""``kernels.bmm_add``: torch.baddbmm's result (``beta * c + alpha * a @ b``), its input ``c``
left as it was, and on 16-bit CUDA stacks one cuBLASLt matmul with no copy of ``c`` (the copy is
what it exists to skip: Note: why bmm_add in csrc/linalg/bmm_add_cuda.cu)."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_MARKS
from matmul_numerics import UNIT, relative

from shardopt import kernels

CUDA_MARK, CUDA_SKIP = CUDA_MARKS

# (batch, p, q, r): odd sizes, one matrix, Newton-Schulz's square and wide products
SHAPES = [(3, 24, 40, 32), (1, 7, 13, 5), (4, 64, 64, 64), (2, 48, 160, 48)]
# which of a and b is a transposed view of a contiguous stack
VIEWS = [(False, False), (True, False), (False, True), (True, True)]


def _stacks(shape, transposed, dtype, device, seed=0):
    k, p, q, r = shape
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, p, q, generator=g, dtype=torch.float64)
    b = torch.randn(k, q, r, generator=g, dtype=torch.float64)
    c = torch.randn(k, p, r, generator=g, dtype=torch.float64)
    if transposed[0]:
        a = a.mT.contiguous().mT
    if transposed[1]:
        b = b.mT.contiguous().mT
    return [t.to(device=device, dtype=dtype) for t in (a, b, c)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_is_baddbmm_bit_for_bit(dtype):
    a, b, c = _stacks(SHAPES[0], VIEWS[1], dtype, "cpu")
    before = c.clone()
    out = kernels.bmm_add(a, b, c, alpha=-0.75, beta=3.25)
    assert torch.equal(out, torch.baddbmm(c, a, b, beta=3.25, alpha=-0.75))
    assert torch.equal(c, before)


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: f"aT{int(v[0])}-bT{int(v[1])}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("alpha,beta", [(1.0, 3.4445), (2.0315, -4.775), (1.0, 0.0)])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_matches_baddbmm_and_fp64(dtype, shape, view, alpha, beta):
    a, b, c = _stacks(shape, view, dtype, "cuda")
    before = c.clone()
    out = kernels.bmm_add(a, b, c, alpha=alpha, beta=beta)
    ref = torch.baddbmm(c.double(), a.double(), b.double(), beta=beta, alpha=alpha)
    torch_out = torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    assert out.shape == c.shape and out.dtype == dtype and out.is_contiguous()
    assert out.data_ptr() != c.data_ptr()
    assert torch.equal(c, before)
    # one rounding of an fp32-accumulated product, as torch's: about torch's own error (the two
    # round the same fp32 sums up to the order of accumulation), and under a unit of the dtype
    assert relative(out, ref) <= 1.5 * relative(torch_out, ref)
    assert relative(out, ref) <= UNIT[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_runs_no_copy_of_c(dtype):
    """torch's baddbmm launches a copy of c before its GEMM; bmm_add launches the GEMM only."""
    a, b, c = _stacks((8, 256, 512, 256), VIEWS[0], dtype, "cuda")
    kernels.bmm_add(a, b, c, beta=2.0)  # warm: the algorithm choice and the workspace

    def kernel_names(fn):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def copies(names):  # torch 2.11's copy of c is "Memcpy DtoD (Device -> Device)"
        return [n for n in names if any(w in n.lower() for w in ("memcpy", "copy", "elementwise"))]

    torch_kernels = kernel_names(lambda: torch.baddbmm(c, a, b, beta=2.0))
    ours = kernel_names(lambda: kernels.bmm_add(a, b, c, beta=2.0))
    assert copies(torch_kernels), torch_kernels  # the premise: torch copies c
    assert ours and not copies(ours), ours


@CUDA_MARK
@CUDA_SKIP
def test_cuda_fp64_and_bad_shapes():
    a, b, c = _stacks(SHAPES[0], VIEWS[0], torch.float64, "cuda")
    assert torch.equal(kernels.bmm_add(a, b, c, beta=0.5), torch.baddbmm(c, a, b, beta=0.5))
    a, b, c = _stacks(SHAPES[0], VIEWS[0], torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match=r"shapes do not chain: a \(3, 24, 40\) @ b \(3, 39"):
        kernels.extension().cuda.bmm_add(a, b[:, :-1], c)
    with pytest.raises(RuntimeError, match=r"must be 3-D .* got shapes \(24, 40\)"):
        kernels.extension().cuda.bmm_add(a[0], b, c)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.extension().cuda.bmm_add(a, b.half(), c)
