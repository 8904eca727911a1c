"""The sharding plan (shardopt.zero.layout) for world sizes 1-8 and sizes that do not divide."""

import random

import pytest

from shardopt.zero.layout import Range, plan_key

CASES = [
    ([1], 1, 1, 1),
    ([7, 3, 278011], 3, 4096, 32),
    ([50, 7, 100], 3, 40, 4),
    ([5] * 300, 4, 64, 8),
    ([1000, 1, 1, 999], 8, 100, 16),
    ([33, 65, 129], 2, 10, 32),
]


def _check(sizes, world, bucket, align):
    layout = plan_key(
        list(enumerate(sizes)), world_size=world, bucket_numel=bucket, align_numel=align
    )
    # params laid out in reverse registration order, aligned, not overlapping
    starts = [layout.space_ranges[i].start for i in layout.params]
    assert list(layout.params) == list(reversed(range(len(sizes))))
    assert starts == sorted(starts)
    for i in layout.params:
        r = layout.space_ranges[i]
        assert r.start % align == 0 and r.numel == sizes[i]
    # buckets tile the key space, each divides by world size with aligned chunks
    pos, shard = 0, 0
    for b in layout.buckets:
        assert b.space_range.start == pos and b.numel % world == 0
        assert b.chunk_numel % align == 0 and b.shard_offset == shard
        pos, shard = b.space_range.end, shard + b.chunk_numel
    assert pos == layout.space_numel and shard == layout.shard_numel
    assert layout.space_numel >= max(r.end for r in layout.space_ranges.values())
    # fragments of each param tile its elements exactly once, and ranges agree in every system
    for i, n in enumerate(sizes):
        covered = [0] * n
        for f in layout.param_fragments(i):
            b = layout.buckets[f.bucket]
            chunk = b.chunk_range(f.rank)
            assert chunk.start <= f.bucket_range.start and f.bucket_range.end <= chunk.end
            assert f.param_range.numel == f.bucket_range.numel == f.shard_range.numel
            space = f.bucket_range.shift(b.space_range.start)
            assert space.shift(-layout.space_ranges[i].start) == f.param_range
            assert f.shard_range.start == b.shard_offset + f.bucket_range.start - chunk.start
            for k in range(f.param_range.start, f.param_range.end):
                covered[k] += 1
        assert covered == [1] * n
    # one rank's fragments never overlap in its shard
    for rank in range(world):
        spans = sorted(
            (f.shard_range.start, f.shard_range.end) for f in layout.rank_fragments(rank)
        )
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(e <= layout.shard_numel for _, e in spans)
    return layout


@pytest.mark.parametrize("sizes,world,bucket,align", CASES)
def test_plan_invariants(sizes, world, bucket, align):
    _check(sizes, world, bucket, align)


@pytest.mark.parametrize("world", range(1, 9))
def test_random_plans(world):
    rng = random.Random(world)
    for _ in range(20):
        sizes = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        _check(sizes, world, rng.randint(1, 500), rng.choice([1, 4, 32]))


def test_straddling_param_has_several_fragments_on_one_rank():
    layout = _check([50, 7, 100], 3, 40, 4)
    frags = [f for f in layout.param_fragments(2) if f.rank == 0]
    assert len(frags) >= 2  # one rank holds several fragments of one param
    assert len({f.bucket for f in layout.param_fragments(2)}) >= 2  # straddles buckets


def test_range_helpers():
    assert Range(0, 5).intersect(Range(5, 9)) is None
    assert Range(0, 5).intersect(Range(3, 9)) == Range(3, 5)
    assert Range(2, 4).shift(3) == Range(5, 7) and Range(2, 4).numel == 2


@pytest.mark.parametrize("kwargs", [dict(world_size=0), dict(align_numel=0)])
def test_bad_plan_arguments(kwargs):
    args = dict(world_size=2, bucket_numel=8, align_numel=4) | kwargs
    with pytest.raises(ValueError):
        plan_key([(0, 3)], **args)
