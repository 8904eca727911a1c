"""The numerics the matmul tests share (tests/kernels/test_bmm_add.py,
test_symmetric_bmm_add.py, test_matmul_tuning.py): seeded fp64 Gaussians, the relative error to
an fp64 reference, and a unit of each 16-bit dtype (the bound of one rounding of an
fp32-accumulated product)."""

import torch

#: one unit in the last place at 1.0 of each 16-bit dtype, as a relative bound
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def gauss(*shape: int, seed: int = 0) -> torch.Tensor:
    """A seeded fp64 Gaussian tensor on the CPU."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` in fp64, on ``ref``'s device."""
    return float((x.double().to(ref.device) - ref).norm() / ref.norm())
