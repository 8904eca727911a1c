"""shardopt/algorithms/muon.py's plan-level helpers: the Newton-Schulz cost and the row blocks."""

import pytest

from shardopt.algorithms import muon


def test_ns_cost_standard_counts_20n2m_plus_10n3_per_matrix():
    assert muon.ns_cost((4096, 4096)) == 30 * 4096**3
    n, m = 768, 3072
    assert muon.ns_cost((m, n)) == muon.ns_cost((n, m)) == 20 * n * n * m + 10 * n**3
    assert muon.ns_cost((n, m), ns_steps=10) == 2 * muon.ns_cost((n, m))
    # a stack over the leading dims: one matrix per index; flatten: one (shape[0], rest) matrix
    assert muon.ns_cost((8, 3, 4, 6)) == 24 * (20 * 16 * 6 + 10 * 64)
    assert muon.ns_cost((8, 3, 4, 6), flatten=True) == 20 * 64 * 72 + 10 * 512


def test_ns_cost_gram_is_8n2m_plus_28n3_and_square_falls_back():
    n, m = 1000, 3500
    assert muon.ns_cost((n, m), ns_algorithm="gram") == 8 * n * n * m + 28 * n**3
    assert muon.ns_cost((512, 512), ns_algorithm="gram") == muon.ns_cost((512, 512))
    # no restart within 2 steps: X Xᵀ, Q X; R², P R P (2), then R², P Q
    assert muon.ns_cost((n, m), ns_steps=2, ns_algorithm="gram") == 4 * n * n * m + 10 * n**3


def test_ns_cost_split_sums_the_blocks():
    d = 64
    qkv = muon.ns_cost((3 * d, d), ns_split=d)
    assert qkv == 3 * muon.ns_cost((d, d))
    heads = muon.ns_cost((3 * d, d), ns_split=16)
    assert heads == 12 * muon.ns_cost((16, d))
    assert muon.ns_cost((96, 64), ns_split=(64, 16, 16)) == muon.ns_cost((64, 64)) + 2 * (
        muon.ns_cost((16, 64))
    )


@pytest.mark.parametrize(
    "rows, split, blocks",
    [
        (12, None, [(2, 12, 5)]),
        (12, 4, [(6, 4, 5)]),
        (12, (4, 4, 4), [(6, 4, 5)]),
        (10, (6, 2, 2), [(2, 6, 5), (4, 2, 5)]),
    ],
)
def test_matrix_blocks(rows, split, blocks):
    assert muon.matrix_blocks((2, rows, 5), False, split) == blocks


@pytest.mark.parametrize("split", [5, 0, (6, 5), (12, 0)])
def test_bad_split_raises(split):
    with pytest.raises(ValueError, match="ns_split"):
        muon.matrix_blocks((12, 5), False, split)
