"""``bmm_add``: ``beta * c + alpha * a @ b`` over a batch of matrices, as ``torch.baddbmm`` with
``c`` as its ``input``, into a new tensor, without the copy of ``c`` torch's CUDA baddbmm makes.

Out of place, torch's CUDA baddbmm copies ``input`` into its result, then runs the GEMM with
beta reading it back. On bf16/fp16 CUDA matrices this runs one cuBLASLt matmul that reads ``c``
and writes the result (csrc/linalg/bmm_add_cuda.cu, Note: why bmm_add): Newton-Schulz's two
products with an addend per step (``algorithms.muon``) skip a read and a write of every matrix.
The arithmetic is baddbmm's (fp32 accumulation, alpha and beta in fp32, one rounding), up to the
GEMM kernel cuBLAS picks. Everything else is ``torch.baddbmm``: CPU tensors, fp32 and fp64 (which
keep torch's TF32 settings), an extension built without CUDA, and while torch.compile traces
(Inductor sees the plain op).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardopt.kernels import loader

_HALF = (torch.bfloat16, torch.float16)


def bmm_add(a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """``beta * c + alpha * (a @ b)`` for 3-D ``a`` (k, p, q), ``b`` (k, q, r), ``c`` (k, p, r):
    ``torch.baddbmm(c, a, b, beta=beta, alpha=alpha)``, a new tensor; ``c`` is only read.

    ``a`` and ``b`` may be transposed views (``x.mT``) of contiguous stacks.

    Example:
        >>> a, b, c = torch.ones(1, 2, 3), torch.ones(1, 3, 2), torch.ones(1, 2, 2)
        >>> bmm_add(a, b, c, alpha=2.0, beta=0.5)[0, 0, 0].item()  # 0.5 * 1 + 2 * 3
        6.5
    """
    if (
        c.is_cuda
        and c.dtype in _HALF
        and a.dtype == b.dtype == c.dtype
        and not torch.compiler.is_compiling()
        and loader.cuda_available()
    ):
        return loader.extension().cuda.bmm_add(a, b, c, float(alpha), float(beta))
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
