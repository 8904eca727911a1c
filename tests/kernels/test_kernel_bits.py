"""The elementwise Adam and Adagrad kernels give the bits of one correctly rounded fp32 operation
per step, in their math header's order (csrc/optim/adam_math.h, adagrad_math.h), on CPU and CUDA,
with fp32/bf16/fp16 grads and fp32/bf16/fp16 out slots.

This is what makes CPU offload exact on a GPU job: the offloaded shard is updated by the CPU kernel
in place of the CUDA one, and both equal this reference (docs/spec.md, CPU offload). It holds
because the builds contract nothing implicitly and keep divisions as divisions
(shardopt/kernels/build.py: -ffp-contract=off, no -freciprocal-math, nvcc --fmad=false), and the
out slot is c10's round-to-nearest-even conversion of the updated fp32 master, whether the loop is
vectorised or not (Note: vectorised CPU loops, csrc/multi_tensor/cpu_apply.h)."""

import pytest
import torch

from shardopt import kernels

# sizes: a vector body, a remainder, one element, and more than one work item of the CPU traversal
SIZES = [100_003, 17, 1, 3 * 16384 + 5]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]


def _f(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # correctly rounded fp32 square root: the double root of an fp32 value rounds correctly
    return torch.sqrt(x.double()).float()


def _inputs(n: int, grad_dtype: torch.dtype, gen: torch.Generator):
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    p[:3] = 0.0  # zero operands
    v[3:6] = 0.0
    return p, g, m, v


def _lists(device, out_dtype, *tensors):
    lists = [[t.clone().to(device)] for t in tensors]
    if out_dtype is not None:
        lists.append([torch.empty(tensors[0].numel(), dtype=out_dtype, device=device)])
    return lists


def _assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} bytes differ"


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_is_bit_identical_to_fp32_operations(adam_w_mode, grad_dtype, out_dtype, device):
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    gen = torch.Generator().manual_seed(3)
    for n in SIZES:
        p, g, m, v = _inputs(n, grad_dtype, gen)
        for step in (1, 7):
            lists = _lists(device, out_dtype, g, p, m, v)
            kernels.adam(
                lists, lr=lr, beta1=b1, beta2=b2, eps=eps, step=step, adam_w_mode=adam_w_mode,
                bias_correction=True, weight_decay=wd,
            )  # fmt: skip
            B1, B2, WD = _f(b1), _f(b2), _f(wd)
            gf = g.float()
            if not adam_w_mode:
                gf = gf + WD * p
            m_new = B1 * m + (_f(1.0) - B1) * gf
            v_new = B2 * v + (_f(1.0) - B2) * gf * gf
            u = (m_new / _f(1 - b1**step)) / (_sqrt(v_new / _f(1 - b2**step)) + _f(eps))
            if adam_w_mode:
                u = u + WD * p
            p_new = p - _f(lr) * u
            _assert_bits(lists[2][0], m_new)
            _assert_bits(lists[3][0], v_new)
            _assert_bits(lists[1][0], p_new)
            if out_dtype is not None:
                _assert_bits(lists[4][0], p_new.to(out_dtype))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("w_mode", [True, False])
def test_adagrad_is_bit_identical_to_fp32_operations(w_mode, grad_dtype, out_dtype, device):
    lr, eps, wd = 1e-2, 1e-10, 0.01
    gen = torch.Generator().manual_seed(4)
    for n in SIZES:
        p, g, _, h = _inputs(n, grad_dtype, gen)
        lists = _lists(device, out_dtype, g, p, h)
        kernels.adagrad(lists, lr=lr, eps=eps, weight_decay=wd, adagrad_w_mode=w_mode)
        WD = _f(wd)
        gf = g.float()
        if not w_mode:
            gf = gf + WD * p
        h_new = h + gf * gf
        u = gf / (_sqrt(h_new) + _f(eps))
        if w_mode:
            u = u + WD * p
        p_new = p - _f(lr) * u
        _assert_bits(lists[2][0], h_new)
        _assert_bits(lists[1][0], p_new)
        if out_dtype is not None:
            _assert_bits(lists[3][0], p_new.to(out_dtype))
