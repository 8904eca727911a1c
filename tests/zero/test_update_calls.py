"""update_calls.py: the per-range sums of LAMB's and NovoGrad's calls added into per-param sums."""

import pytest
import torch

from shardopt.zero.update_calls import sum_by_param


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
            ],
        ),
    ],
)
def test_sum_by_param_adds_each_params_pieces_in_order(device):
    """Per-range sums (LAMB's, NovoGrad's) into per-param sums. On the CPU a param's pieces in
    call and range order, one after the other from its value in ``out``; on CUDA the same bits
    run after run (``index_add_`` added duplicates with atomics) in the kernel's own order, the
    same values up to rounding. (That the order matches between a GPU update and an offloaded
    one is tested by tests/offload/test_offload_cuda.py: both add on the device.)"""
    gen = torch.Generator().manual_seed(0)
    index = [torch.tensor([0, 1]), torch.tensor([1, 2, 1]), torch.tensor([1, 3])]
    # magnitudes far apart, so that another order of the additions rounds differently
    values = [
        torch.randn(t.numel(), generator=gen) * 10.0 ** (4 * k - 4) for k, t in enumerate(index)
    ]
    start = torch.randn(4, generator=gen)
    want = start.clone()
    for ix, vals in zip(index, values):
        for i, v in zip(ix.tolist(), vals):
            want[i] = want[i] + v
    got = []
    for _ in range(3):
        out = start.clone().to(device)
        sum_by_param(out, [t.to(device) for t in index], [v.to(device) for v in values])
        got.append(out.cpu())
    assert all(torch.equal(g, got[0]) for g in got)
    if device == "cpu":
        assert torch.equal(got[0], want)
    else:
        torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-3)
    out = start.clone().to(device)
    sum_by_param(out, [], [])
    assert torch.equal(out.cpu(), start)
