"""shardopt.state_codec: the master split, the quantization maps and the compact state formats."""

import math

import pytest
import torch

from shardopt import state_codec as sc

BLOCKWISE = ["scaled_fp16", "int8"]
REMAINDERS = [-0x8000, -0x7FFF, -12345, -1, 0, 1, 0x4000, 0x7FFF]


def _bits(x):
    return x.view(torch.int32)


def _all_pairs():
    """Every bf16 pattern x a spread of remainders (the extremes included), as int64 (hi, lo)."""
    hi = torch.arange(0x10000, dtype=torch.int64).repeat_interleave(len(REMAINDERS))
    lo = torch.tensor(REMAINDERS, dtype=torch.int64).repeat(0x10000)
    return hi, lo


def _as_param(hi):
    return torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16)


def test_join_then_split_is_exact_on_every_bf16_pattern():
    hi, lo = _all_pairs()
    master = sc.join_master(_as_param(hi), lo.to(torch.int16))
    u = ((hi << 16) + lo) & 0xFFFFFFFF
    assert torch.equal(master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, u)
    param, rem = sc.split_master(master)
    finite_or_inf = ~torch.isnan(master)
    assert finite_or_inf.sum() > 0.99 * len(hi)
    assert torch.equal(
        param.view(torch.int16)[finite_or_inf], _as_param(hi).view(torch.int16)[finite_or_inf]
    )
    assert torch.equal(rem[finite_or_inf], lo.to(torch.int16)[finite_or_inf])


def test_split_then_join_is_exact_on_random_fp32():
    master = torch.cat(
        [
            torch.randn(100_000) * 10.0 ** torch.randint(-30, 30, (100_000,)),
            torch.randint(-(2**31), 2**31 - 1, (100_000,), dtype=torch.int32).view(torch.float32),
        ]
    )
    master = master[~torch.isnan(master)]
    param, rem = sc.split_master(master)
    assert param.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert torch.equal(_bits(sc.join_master(param, rem)), _bits(master))


def test_split_rounds_half_away_from_zero_and_otherwise_to_nearest_even():
    hi, lo = _all_pairs()
    master = sc.join_master(_as_param(hi), lo.to(torch.int16))
    ok = torch.isfinite(master) & (master.abs() < 3e38)
    master, lo = master[ok], lo[ok]
    param, rem = sc.split_master(master)
    tie = lo == -0x8000
    rne = master.to(torch.bfloat16)
    assert torch.equal(param[~tie].view(torch.int16), rne[~tie].view(torch.int16))
    # at a tie the param is the larger magnitude: master + half an ulp away from zero
    p, m = param[tie].double(), master[tie].double()
    assert (p.abs() > m.abs()).all()
    normal = m.abs() >= 2.0**-126  # subnormals have a fixed ulp
    half_ulp = (p.abs() - m.abs())[normal]
    want = torch.ldexp(torch.ones_like(m), torch.frexp(m).exponent - 9)[normal]
    assert torch.equal(half_ulp, want)
    assert (rem[tie] == -0x8000).all()
    # and RNE differs there exactly when the lower bf16 neighbour is even
    even = (param[tie].view(torch.int16) & 1) == 1  # param odd <=> truncation even
    assert torch.equal(param[tie][even].view(torch.int16) - 1, rne[tie][even].view(torch.int16))


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF])
def test_nan_master_gives_a_signed_quiet_nan_param_and_zero_remainder(bits):
    signed = bits - 2**32 if bits >= 2**31 else bits
    master = torch.tensor([signed, 0x3F800000], dtype=torch.int32).view(torch.float32)
    param, rem = sc.split_master(master)
    want = 0x7FC0 | ((bits >> 31) << 15)
    assert param.view(torch.int16)[0].item() & 0xFFFF == want
    assert rem.tolist() == [0, 0]
    assert math.isnan(sc.join_master(param, rem)[0].item())
    assert param[1].item() == 1.0


def test_infinite_master_stays_infinite():
    master = torch.tensor([math.inf, -math.inf])
    param, rem = sc.split_master(master)
    assert param.tolist() == [math.inf, -math.inf] and rem.tolist() == [0, 0]


def test_split_and_join_refuse_wrong_dtypes():
    with pytest.raises(TypeError, match="master must be a torch.float32"):
        sc.split_master(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="remainder must be a torch.int16"):
        sc.join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        sc.join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int16))


@pytest.mark.parametrize("signed", [True, False])
def test_quantization_map_properties(signed):
    values = sc.quantization_map(signed)
    assert values.dtype == torch.float32 and values.shape == (256,)
    assert (values[1:] > values[:-1]).all()
    assert values[-1].item() == 1.0 and (values == 0).sum() == 1
    if signed:
        assert values[0].item() == -1.0
        assert sc.zero_code(True) == 127
    else:
        assert values[0].item() == 0.0 and sc.zero_code(False) == 0
    assert sc.quantization_map(signed) is values  # cached
    # a tree map: about 2^k values per decade, the finest near 1
    gaps = values[1:] - values[:-1]
    assert gaps.max().item() < 0.025
    assert values.abs().min().item() == 0.0 and (values.abs() > 0).sum() == 255


def test_quantization_map_matches_the_tree_construction():
    """Spot values of bitsandbytes' create_dynamic_map (its float32 linspace; ours is float64)."""
    unsigned = sc.quantization_map(False)
    assert unsigned[1].item() == pytest.approx(0.325e-6, rel=1e-6)  # level 0: 2 means
    assert unsigned[-2].item() == pytest.approx(1 - 0.45 / 128, rel=1e-6)
    signed = sc.quantization_map(True)
    assert signed[128].item() == pytest.approx(0.55e-6, rel=1e-6)
    assert signed[-2].item() == pytest.approx(1 - 0.45 / 64, rel=1e-6)
    assert signed[126].item() == pytest.approx(-0.325e-5, rel=1e-6)  # -0.55e-6 made way for -1


def test_format_table():
    assert sc.FORMATS == ("fp32", "bf16", "fp16", "scaled_fp16", "int8")
    assert [sc.code_dtype(f) for f in sc.FORMATS] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float16,
        torch.uint8,
    ]
    assert [sc.has_scales(f) for f in sc.FORMATS] == [False, False, False, True, True]
    assert [sc.bytes_per_element(f) for f in sc.FORMATS] == [4, 2, 2, 2 + 4 / 256, 1 + 4 / 256]
    assert [sc.num_blocks(n) for n in (0, 1, 256, 257, 1000)] == [0, 1, 1, 2, 4]
    with pytest.raises(ValueError, match="unknown state format 'int4'"):
        sc.code_dtype("int4")


def _values(n, seed=0):
    """Moment-like values: a scale per block spread over decades, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    decades = torch.randint(-8, 3, (sc.num_blocks(n),), generator=g)
    x = torch.randn(n, generator=g) * (10.0**decades).repeat_interleave(256)[:n]
    x[torch.randint(0, n, (n // 20,), generator=g)] = 0.0
    return x


def _root(x):
    return torch.sqrt(x.double()).float()  # correctly rounded


def _block_amax(x):
    n = x.numel()
    padded = torch.nn.functional.pad(x.abs(), (0, sc.num_blocks(n) * 256 - n))
    return padded.view(-1, 256).amax(1).repeat_interleave(256)[:n]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_plain_formats_are_casts(fmt):
    x = _values(1000)
    codes, scales = sc.encode(x, fmt, signed=True)
    assert scales is None and torch.equal(codes, x.to(sc.code_dtype(fmt)))
    assert torch.equal(sc.decode(codes, None, fmt, signed=True), codes.float())


def test_scaled_fp16_error_and_scales():
    x = _values(256 * 40 + 77)
    codes, scales = sc.encode(x, "scaled_fp16", signed=True)
    assert codes.dtype == torch.float16 and scales.shape == (41,)
    y = sc.decode(codes, scales, "scaled_fp16", signed=True)
    amax = _block_amax(x)
    assert ((y - x).abs() <= amax * 2.0**-11).all()
    # the scale is 2^(E - 15) for amax = f * 2^E, f in [0.5, 1)
    block_amax = amax[::256]
    want = torch.ldexp(torch.ones_like(block_amax), torch.frexp(block_amax).exponent - 15)
    assert torch.equal(scales, want)
    assert (codes.float().abs() < 2**15).all()


@pytest.mark.parametrize("signed", [True, False])
def test_int8_error_is_at_most_half_the_local_map_spacing(signed):
    """m's error, and that of v's root (the stored value), relative to the block amax."""
    x = _values(256 * 40 + 77, seed=int(signed))
    if not signed:
        x = x.abs()
    codes, scales = sc.encode(x, "int8", signed=signed)
    assert codes.dtype == torch.uint8 and scales.shape == (41,)
    y = sc.decode(codes, scales, "int8", signed=signed)
    if not signed:
        x, y = _root(x), _root(y)
    values = sc.quantization_map(signed)
    padded = torch.cat([values[:1], values, values[-1:]])
    half_gap = torch.maximum(padded[1:-1] - padded[:-2], padded[2:] - padded[1:-1]) / 2
    amax = _block_amax(x)
    bound = (half_gap[codes.long()] + 1e-6) * amax
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(scales, amax[::256])


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_count_the_midpoints_below(signed):
    """The encode rule spelled out: code = #{j < 255: mid[j] < x * (1 / amax)}, ties down."""
    values = sc.quantization_map(signed)
    mids = (values[:-1] + values[1:]) * 0.5
    x = torch.cat(
        [torch.tensor([1.0]), mids[::3], torch.rand(100) * (2 if signed else 1) - int(signed)]
    )
    x = x[:256]
    # v: the rule on its root x (sqrt(fl(x * x)) == x), a positive one never takes the zero code
    codes, scales = sc.encode(x if signed else x * x, "int8", signed=signed)
    xn = x * (1.0 / scales[0])
    want = (mids[None, :] < xn[:, None]).sum(1)
    if not signed:
        want = torch.where(x > 0, want.clamp(min=1), want)
    assert torch.equal(codes.long(), want)
    # x == mids[0]: the tie goes to the lower code (0.0), but for v, whose positive values
    # never decode to 0: code 1
    assert codes[1].item() == (0 if signed else 1)


@pytest.mark.parametrize("fmt", BLOCKWISE)
def test_partial_last_block_is_encoded_on_its_own(fmt):
    x = _values(3 * 256 + 17)
    codes, scales = sc.encode(x, fmt, signed=True)
    tail_codes, tail_scales = sc.encode(x[768:].clone(), fmt, signed=True)
    assert torch.equal(codes[768:], tail_codes) and torch.equal(scales[3:], tail_scales)
    head_codes, head_scales = sc.encode(x[:768].clone(), fmt, signed=True)
    assert torch.equal(codes[:768], head_codes) and torch.equal(scales[:3], head_scales)


@pytest.mark.parametrize("fmt", sc.FORMATS)
@pytest.mark.parametrize("signed", [True, False])
def test_zeros_stay_zero_whatever_the_scale(fmt, signed):
    x = _values(256 * 6 + 5).abs()
    x[256 * 2 : 256 * 3] = 0.0  # an all-zero block
    x[5::7] = 0.0
    x[-3:] = 0.0  # padding-like tail
    codes, scales = sc.encode(x, fmt, signed=signed)
    y = sc.decode(codes, scales, fmt, signed=signed)
    zero = x == 0
    assert (y[zero] == 0).all() and not torch.signbit(y[zero]).any()
    if fmt == "int8":
        assert scales[2].item() == 0.0
    if fmt == "scaled_fp16":
        assert scales[2].item() == 1.0


@pytest.mark.parametrize("fmt", BLOCKWISE)
def test_encode_is_deterministic(fmt):
    x = _values(256 * 50 + 3)
    a = sc.encode(x, fmt, signed=True)
    b = sc.encode(x.clone(), fmt, signed=True)
    assert torch.equal(a[0], b[0]) and torch.equal(_bits(a[1]), _bits(b[1]))


def test_non_finite_values():
    x = torch.ones(3 * 256)
    x[10] = math.nan
    x[300] = math.inf
    codes, scales = sc.encode(x, "scaled_fp16", signed=True)
    y = sc.decode(codes, scales, "scaled_fp16", signed=True)
    assert math.isnan(y[10].item()) and y[300].item() == math.inf
    assert (y[:10] == 1).all() and (y[256:300] == 1).all() and (y[512:] == 1).all()
    assert scales[:2].tolist() == [1.0, 1.0]
    codes, scales = sc.encode(x, "int8", signed=True)
    assert _bits(scales)[0].item() == 0x7FC00000 and scales[1].item() == math.inf
    y = sc.decode(codes, scales, "int8", signed=True)
    assert torch.isnan(y[:512]).all() and (y[512:] == 1).all()
    assert (codes[:512] == sc.zero_code(True)).all()


def test_subnormal_blocks():
    x = torch.zeros(512)
    x[:256] = 1e-40
    x[3] = 0.0
    codes, scales = sc.encode(x, "int8", signed=True)
    assert scales[0].item() == 0.0 and (sc.decode(codes, scales, "int8", signed=True) == 0).all()
    codes, scales = sc.encode(x, "scaled_fp16", signed=True)
    assert scales[0].item() == 2.0**-126
    y = sc.decode(codes, scales, "scaled_fp16", signed=True)
    assert ((y - x).abs() <= x * 2.0**-11).all() and y[3] == 0
    # a subnormal v has a normal root (1e-20): its block is an ordinary one, and v stays positive
    for fmt in sc.ROOT_FORMATS:
        codes, scales = sc.encode(x, fmt, signed=False)
        y = sc.decode(codes, scales, fmt, signed=False)
        assert (y[:256] > 0).sum() == 255 and y[3] == 0 and (y[256:] == 0).all(), fmt


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: sc.encode(torch.zeros(4), "int4", signed=True),
            ValueError,
            "unknown state format",
        ),
        (
            lambda: sc.encode(torch.zeros(4, dtype=torch.float16), "int8", signed=True),
            TypeError,
            "x must be a torch.float32",
        ),
        (lambda: sc.encode(torch.zeros(2, 4), "int8", signed=True), ValueError, "1-D"),
        (
            lambda: sc.decode(
                torch.zeros(300, dtype=torch.uint8), torch.zeros(1), "int8", signed=True
            ),
            ValueError,
            "300 codes need 2 scales",
        ),
        (
            lambda: sc.decode(torch.zeros(3, dtype=torch.uint8), None, "int8", signed=True),
            ValueError,
            "needs its per-block scales",
        ),
        (
            lambda: sc.decode(torch.zeros(3), torch.zeros(1), "fp32", signed=True),
            ValueError,
            "has no scales",
        ),
        (
            lambda: sc.decode(
                torch.zeros(3, dtype=torch.int8), torch.zeros(1), "int8", signed=True
            ),
            TypeError,
            "int8 codes must be a torch.uint8",
        ),
    ],
)
def test_bad_input_raises(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_which_formats_keep_the_root_of_v():
    assert sc.VERSION == 2 and sc.ROOT_FORMATS == ("fp16", "scaled_fp16", "int8")
    assert [sc.stores_root(f, False) for f in sc.FORMATS] == [False, False, True, True, True]
    assert not any(sc.stores_root(f, True) for f in sc.FORMATS)


@pytest.mark.parametrize("fmt", ["fp16", "scaled_fp16"])
def test_v_is_kept_as_its_root(fmt):
    """The codes of v are those of its correctly rounded root (encoded as m would be, where the
    root is not below the smallest positive code); v decodes as the decoded root squared."""
    v = _values(256 * 8 + 9, seed=4).abs() + 1e-3
    codes, scales = sc.encode(v, fmt, signed=False)
    root_codes, root_scales = sc.encode(_root(v), fmt, signed=True)
    assert torch.equal(codes, root_codes)
    assert (scales is None and root_scales is None) or torch.equal(scales, root_scales)
    r = sc.decode(codes, scales, fmt, signed=True)
    assert torch.equal(sc.decode(codes, scales, fmt, signed=False), r * r)


def _decades_per_block(blocks, top, seed, span=40):
    """Per block an amax 10^top[b] and values down to ``span`` decades below it (zeros
    included)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.tensor(top, dtype=torch.float64).repeat_interleave(256)
    x = 10.0 ** (amax - torch.rand(blocks * 256, generator=g, dtype=torch.float64) * span)
    x[::256] = 10.0 ** amax[::256]
    x = x.float()
    x[7::50] = 0.0
    return x


@pytest.mark.parametrize("fmt", sc.FORMATS[1:])
def test_a_positive_v_never_decodes_to_zero(fmt):
    v = _decades_per_block(4, [6, 0, -6, -12], seed=5)
    assert (v > 0).sum() > 900 and (v[v > 0] < 1e-38).any()  # subnormal v included
    y = sc.decode(*sc.encode(v, fmt, signed=False), fmt, signed=False)
    assert torch.equal(y > 0, v > 0)


@pytest.mark.parametrize("fmt", sc.FORMATS)
def test_where_m_decodes_nonzero_v_does_too(fmt):
    """Adam's moments after one step of grads over 12 decades per block (m = 0.1 g, v = 1e-3 g^2,
    m / sqrt(v) = 3.16; v >= 1e-39 is positive in fp32): wherever m decodes nonzero, the decoded
    m / sqrt(v) stays within a factor 2 of that (v kept as v underflowed first: the update
    became m / eps)."""
    g = _decades_per_block(4, [0, -2, -4, -6], seed=6, span=12)
    g[::3] *= -1
    m, v = 0.1 * g, 1e-3 * g * g
    dm = sc.decode(*sc.encode(m, fmt, signed=True), fmt, signed=True).double()
    dv = sc.decode(*sc.encode(v, fmt, signed=False), fmt, signed=False).double()
    live = dm != 0
    assert live.sum() > 100 and (dv[live] > 0).all()
    ratio = dm[live].abs() / dv[live].sqrt()
    true_ratio = 0.1 / math.sqrt(1e-3)
    assert (ratio <= 2 * true_ratio).all(), ratio.max().item()
