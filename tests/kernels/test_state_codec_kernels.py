"""The compact state codec inside the kernels (csrc/optim/state_codec.h) against
shardopt.state_codec, bit for bit: encode (beta1 = beta2 = 0, lr = 0: m = g, v = g * g), decode
(beta1 = beta2 = 1: the kernel re-encodes what it decodes), non-finite blocks, the NaN master, and
the tables the kernels are built from."""

import re

import pytest
import torch
from compact_state import HYPER, Compact, make_grads

from shardopt import state_codec as sc
from shardopt.kernels import build as _build
from shardopt.kernels import compact as _compact_ops


def _codec_values(n, device):
    """Values over many decades per block, zeros, an all-zero and a subnormal block."""
    gen = torch.Generator().manual_seed(3)
    decades = torch.randint(-12, 4, (sc.num_blocks(n),), generator=gen).double()
    x = torch.randn(n, generator=gen) * (10.0**decades).float().repeat_interleave(256)[:n]
    x[::13] = 0.0
    x[256:512] = 0.0
    tiny = x[512:768]
    tiny.copy_(torch.randn(tiny.numel(), generator=gen) * 1e-41)
    return x.to(device)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "scaled_fp16", "int8"])
def test_the_kernels_encode_as_state_codec(fmt, device):
    """beta1 = beta2 = 0 and lr = 0: m = g and v = g * g, encoded by the kernel."""
    sizes = [5000, 1, 256, 300]
    state = Compact(sizes, "fp32", fmt, device)
    grads = [_codec_values(n, device) for n in sizes]
    hyper = dict(HYPER, lr=0.0, beta1=0.0, beta2=0.0)
    _compact_ops.adam_compact(state.lists(grads), step=1, state_format=fmt, **hyper)
    for i, g in enumerate(grads):
        for x, signed, codes, scales in (
            (g, True, state.exp_avg, state.exp_avg_scales),
            (g * g, False, state.exp_avg_sq, state.exp_avg_sq_scales),
        ):
            want_codes, want_scales = sc.encode(x, fmt, signed=signed)
            assert torch.equal(codes[i].cpu().view(torch.uint8), want_codes.cpu().view(torch.uint8))
            if want_scales is not None:
                assert torch.equal(scales[i].view(torch.int32), want_scales.view(torch.int32))


@pytest.mark.parametrize("fmt", ["scaled_fp16", "int8"])
def test_the_kernels_encode_non_finite_blocks_as_state_codec(fmt, device):
    n = 1000
    grads = [_codec_values(n, device)]
    grads[0][10] = float("inf")
    grads[0][600] = float("nan")
    state = Compact([n], "fp32", fmt, device)
    hyper = dict(HYPER, lr=0.0, beta1=0.0, beta2=0.0)
    _compact_ops.adam_compact(state.lists(grads), step=1, state_format=fmt, **hyper)
    want_codes, want_scales = sc.encode(grads[0], fmt, signed=True)
    assert torch.equal(state.exp_avg[0].view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(state.exp_avg_scales[0].view(torch.int32), want_scales.view(torch.int32))


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "scaled_fp16", "int8"])
def test_the_kernels_decode_as_state_codec(fmt, device):
    """beta1 = beta2 = 1: the kernel re-encodes the moments it decodes."""
    sizes = [2000, 3]
    state = Compact(sizes, "fp32", fmt, device)
    m0, v0 = state.moments()
    hyper = dict(HYPER, lr=0.0, beta1=1.0, beta2=1.0, bias_correction=False)
    _compact_ops.adam_compact(
        state.lists(make_grads(sizes, torch.float32, device, 1)), step=1, state_format=fmt, **hyper
    )
    for i in range(len(sizes)):
        for x, signed, codes in ((m0[i], True, state.exp_avg), (v0[i], False, state.exp_avg_sq)):
            want, _ = sc.encode(x, fmt, signed=signed)
            assert torch.equal(codes[i], want)


def test_nan_master_splits_to_a_quiet_nan_param(device):
    state = Compact([300], "bf16+rem", "fp32", device)
    grads = make_grads([300], torch.float32, device, 1)
    grads[0][7] = float("nan")
    _compact_ops.adam_compact(state.lists(grads), step=1, state_format="fp32", **HYPER)
    bits = state.params[0].view(torch.int16)[7].item() & 0xFFFF
    assert bits & 0x7FFF == 0x7FC0 and state.remainders[0][7].item() == 0
    assert torch.isfinite(state.params[0][8:]).all()


def test_quantization_map_header_is_state_codec_map():
    text = (_build.CSRC / "optim" / "quantization_map.h").read_text()
    for name, signed in (("SIGNED", True), ("UNSIGNED", False)):
        body = re.search(rf"#define SHARDOPT_{name}_MAP_BITS \\\n(.*?)\n\n", text + "\n\n", re.S)
        bits = [int(w, 16) for w in re.findall(r"0x([0-9a-f]{8})u", body.group(1))]
        want = (sc.quantization_map(signed).view(torch.int32).long() & 0xFFFFFFFF).tolist()
        assert bits == want


@pytest.mark.parametrize("signed", [True, False])
def test_int8_search_buckets_hold_at_most_two_entries(signed):
    """state_codec.h's search: buckets of (bits >> 17) from 2^-24, kProbe = 2 probes each, over
    the positive mids and nextdown(|mid|) of the negative ones."""
    values = sc.quantization_map(signed)
    mids = (values[:-1] + values[1:]) * 0.5
    negative = ((-mids[mids < 0]).view(torch.int32) - 1).view(torch.float32)
    for side in (mids[mids > 0], negative):
        if side.numel() == 0:
            continue
        buckets = (side.view(torch.int32) >> 17) - (103 << 6)
        assert (buckets > 0).all() and buckets.max() <= 1536
        assert torch.bincount(buckets).max() <= 2


@pytest.mark.parametrize("signed", [True, False])
def test_int8_search_words_hold_at_most_one_entry(signed):
    """The CUDA kernel's search (state_codec.h, int8_code_search): buckets of (bits >> 16) from
    2^-24 up to 2 hold at most one entry of a side, so a code is one lookup and one comparison."""
    values = sc.quantization_map(signed)
    mids = (values[:-1] + values[1:]) * 0.5
    negative = ((-mids[mids < 0]).view(torch.int32) - 1).view(torch.float32)
    for side in (mids[mids > 0], negative):
        if side.numel() == 0:
            continue
        bits = side.view(torch.int32).long()
        assert (bits >= 0x33800000).all() and (bits < 0x40000000).all()
        assert torch.bincount(bits >> 16).max() <= 1
