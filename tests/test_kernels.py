"""The norm and scale kernels through shardopt._ops: determinism, accuracy, inf/nan, dtypes."""

import math

import pytest
import torch
from conftest import DTYPES, make_tensors, skip_unsupported

from shardopt import _ops

# fp32 accumulation over 16384-element chunks (typical error sqrt(n) * 6e-8); fp64 in fp64
NORM_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float64: 1e-13}


def _shapes(device):
    return [(278011,), (_ops.chunk_size(device) + 5,), (1,), (7,), (0,), (3, 4)]


def test_norm_is_bitwise_deterministic_across_runs_and_thread_counts(device):
    tensors = make_tensors(_shapes(device), torch.float32, device)
    first = _ops.norm(tensors)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            for _ in range(3):
                total, per = _ops.norm(tensors)
                assert torch.equal(total, first[0]) and torch.equal(per, first[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_per_tensor_and_total_match_fp64(dtype, device):
    skip_unsupported(dtype, device)
    tensors = make_tensors(_shapes(device), dtype, device)
    total, per = _ops.norm(tensors)
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
    total, per = _ops.norm(tensors, max_norm=True)
    want = [t.abs().max().double().item() if t.numel() else 0.0 for t in tensors]
    assert per.double().cpu().tolist() == want
    assert total.item() == max(want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("max_norm", [False, True])
def test_norm_propagates_nan_and_inf(bad, max_norm, device):
    tensors = make_tensors([(_ops.chunk_size(device) + 100,), (5,), (3,)], torch.float32, device)
    tensors[0][_ops.chunk_size(device) + 1] = bad
    total, per = _ops.norm(tensors, max_norm=max_norm)
    expect_nan = math.isnan(bad)
    for value in (total.item(), per[0].item()):
        assert math.isnan(value) if expect_nan else value == math.inf
    assert torch.isfinite(per[1:]).all()


def test_norm_of_empty_list_is_zero():
    total, per = _ops.norm([])
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
    total, per = _ops.norm(tensors)
    assert total.dtype == per.dtype == torch.float32
    want = torch.stack([torch.linalg.vector_norm(t.double().cpu()) for t in tensors])
    torch.testing.assert_close(per.sqrt().double().cpu(), want, rtol=1e-5, atol=0)
    _, per_max = _ops.norm(tensors, max_norm=True)
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
    src = make_tensors([(_ops.chunk_size(device) + 5,), (1,), (7,)], src_dtype, device)
    dst = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    found_inf = torch.zeros(1, device=device)
    _ops.scale(src, dst, found_inf, scale=0.125)
    acc = torch.float64 if src_dtype == torch.float64 else torch.float32
    for s, d in zip(src, dst):
        assert torch.equal(d, (s.to(acc) * 0.125).to(dst_dtype))
    assert found_inf.item() == 0.0
    scale_t = torch.tensor([4.0], device=device)
    _ops.scale(src, dst, found_inf, scale=0.125, scale_t=scale_t)  # the tensor wins
    for s, d in zip(src, dst):
        assert torch.equal(d, (s.to(acc) * 4.0).to(dst_dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_scale_sets_found_inf_and_works_in_place(bad, device):
    src = make_tensors([(_ops.chunk_size(device) + 5,), (3,)], torch.float32, device)
    src[0][-1] = bad
    expect = [(s * 0.5) for s in src]
    found_inf = torch.zeros(1, device=device)
    _ops.scale(src, src, found_inf, scale=0.5)
    assert found_inf.item() == 1.0
    torch.testing.assert_close(src[1], expect[1], rtol=0, atol=0)
    torch.testing.assert_close(src[0][:-1], expect[0][:-1], rtol=0, atol=0)
    clean = make_tensors([(5,)], torch.float32, device)
    flag = torch.zeros(1, device=device)
    _ops.scale(clean, clean, flag, scale=2.0)
    assert flag.item() == 0.0


def test_scale_of_empty_list_is_a_noop():
    flag = torch.zeros(1)
    _ops.scale([], [], flag, scale=2.0)
    assert flag.item() == 0.0
