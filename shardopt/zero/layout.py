"""The sharding plan: pure data, no torch.distributed (see Note: buckets and shards).

Note: buckets and shards
    Trainable params are grouped by key (param group, param dtype). Within a key, params are laid
    out back to back in reverse registration order (about the order their grads arrive), each
    start aligned to ``align_numel`` elements, in one "key space". The key space is cut into
    buckets of ``bucket_numel`` elements (the last one shorter); every bucket is padded so it
    divides evenly by ``world_size`` and each rank's chunk stays aligned. Rank r owns chunk r of
    every bucket. A rank's shard of a key is its chunks, back to back. A param may straddle buckets
    and chunks; a fragment is one (param, bucket, rank) intersection.

Ranges always name their coordinate system: ``param_range`` (elements of the flattened param),
``bucket_range`` (elements of the bucket), ``shard_range`` (elements of a rank's shard of the key),
``space_range`` (elements of the key space). ``numel`` counts elements, never bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Half-open element range [start, end)."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def intersect(self, other: Range) -> Range | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> Range:
        return Range(self.start + offset, self.end + offset)


@dataclass(frozen=True)
class Fragment:
    """The part of one param that lies in one rank's chunk of one bucket."""

    param: int  # index into Layout.params (the engine's global param index)
    bucket: int  # index into KeyLayout.buckets
    rank: int
    param_range: Range
    bucket_range: Range
    shard_range: Range


@dataclass(frozen=True)
class Bucket:
    """One bucket of a key: its place in the key space and its per-rank chunks."""

    index: int
    space_range: Range  # includes the padding
    chunk_numel: int
    shard_offset: int  # where this bucket's chunk starts in every rank's shard
    params: tuple[int, ...]  # params with at least one element in the bucket
    gaps: tuple[Range, ...] = ()  # bucket ranges holding no param (alignment, padding)

    @property
    def numel(self) -> int:
        return self.space_range.numel

    def chunk_range(self, rank: int) -> Range:
        """Rank's chunk in bucket coordinates."""
        return Range(rank * self.chunk_numel, (rank + 1) * self.chunk_numel)


@dataclass(frozen=True)
class KeyLayout:
    """The plan of one key: param placements, buckets, fragments."""

    params: tuple[int, ...]  # global param indices, in layout (reverse registration) order
    space_ranges: dict[int, Range]  # param -> its elements in the key space
    buckets: tuple[Bucket, ...]
    fragments: tuple[Fragment, ...]  # all ranks, ordered by (bucket, rank, param position)
    space_numel: int  # total, padding included
    shard_numel: int  # every rank's shard length
    bucket_numel: int = 0  # the capacity of a full bucket (the last one may be shorter)

    def rank_fragments(self, rank: int) -> list[Fragment]:
        return [f for f in self.fragments if f.rank == rank]

    def param_fragments(self, param: int) -> list[Fragment]:
        return [f for f in self.fragments if f.param == param]

    def param_pieces(self, param: int) -> list[tuple[int, Range, Range]]:
        """(bucket index, bucket_range, param_range) of each bucket a param has elements in."""
        space = self.space_ranges[param]
        pieces = []
        for b in self.buckets:
            piece = space.intersect(b.space_range)
            if piece is not None:
                pieces.append(
                    (b.index, piece.shift(-b.space_range.start), piece.shift(-space.start))
                )
        return pieces


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _gaps(space: Range, members: tuple[int, ...], space_ranges: dict[int, Range]) -> tuple:
    """The bucket ranges of ``space`` no member param covers (members are in space order)."""
    gaps, cursor = [], space.start
    for i in members:
        piece = space_ranges[i].intersect(space)
        if piece.start > cursor:
            gaps.append(Range(cursor, piece.start).shift(-space.start))
        cursor = max(cursor, piece.end)
    if cursor < space.end:
        gaps.append(Range(cursor, space.end).shift(-space.start))
    return tuple(gaps)


def plan_key(
    params: list[tuple[int, int]],
    *,
    world_size: int,
    bucket_numel: int,
    align_numel: int,
) -> KeyLayout:
    """Plans one key.

    Args:
        params: (global param index, numel) in REGISTRATION order; laid out reversed.
        world_size: ranks sharing the key.
        bucket_numel: target bucket size in elements (rounded up to whole aligned chunks).
        align_numel: alignment of param starts and chunk starts, in elements.

    Returns:
        The key's layout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align_numel < 1:
        raise ValueError(f"align_numel must be >= 1, got {align_numel}")
    unit = world_size * align_numel
    bucket_numel = max(_round_up(max(bucket_numel, 1), unit), unit)

    order = [p for p in reversed(params)]
    space_ranges: dict[int, Range] = {}
    offset = 0
    for index, numel in order:
        offset = _round_up(offset, align_numel)
        space_ranges[index] = Range(offset, offset + numel)
        offset += numel
    used = offset

    buckets: list[Bucket] = []
    start = 0
    shard_offset = 0
    while start < used:
        numel = min(bucket_numel, _round_up(used - start, unit))
        space = Range(start, start + numel)
        members = tuple(i for i, _ in order if space_ranges[i].intersect(space) and numel > 0)
        chunk = numel // world_size
        buckets.append(
            Bucket(
                len(buckets),
                space,
                chunk,
                shard_offset,
                members,
                _gaps(space, members, space_ranges),
            )
        )
        shard_offset += chunk
        start += numel

    fragments: list[Fragment] = []
    for bucket in buckets:
        for rank in range(world_size):
            chunk = bucket.chunk_range(rank).shift(bucket.space_range.start)  # key space
            for index in bucket.params:
                piece = space_ranges[index].intersect(chunk)
                if piece is None:
                    continue
                param_start = space_ranges[index].start
                fragments.append(
                    Fragment(
                        param=index,
                        bucket=bucket.index,
                        rank=rank,
                        param_range=piece.shift(-param_start),
                        bucket_range=piece.shift(-bucket.space_range.start),
                        shard_range=piece.shift(-chunk.start + bucket.shard_offset),
                    )
                )
    return KeyLayout(
        params=tuple(i for i, _ in order),
        space_ranges=space_ranges,
        buckets=tuple(buckets),
        fragments=tuple(fragments),
        space_numel=start,
        shard_numel=shard_offset,
        bucket_numel=bucket_numel,
    )
