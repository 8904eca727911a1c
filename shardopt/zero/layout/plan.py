"""The plan of one key as plain data, and the interface every shard layout implements.

Ranges always name their coordinate system: ``param_range`` (elements of the flattened param),
``bucket_range`` (elements of the bucket), ``shard_range`` (elements of a rank's shard of the key),
``space_range`` (elements of the key space). ``numel`` counts elements, never bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: one param as a layout sees it: (engine param index, shape)
ParamShape = tuple[int, tuple[int, ...]]


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
    params: tuple[int, ...]  # params with at least one element in the bucket, in space order
    gaps: tuple[Range, ...] = ()  # bucket ranges holding no param (alignment, padding)

    @property
    def numel(self) -> int:
        return self.space_range.numel

    def chunk_range(self, rank: int) -> Range:
        """Rank's chunk in bucket coordinates."""
        return Range(rank * self.chunk_numel, (rank + 1) * self.chunk_numel)


@dataclass(frozen=True)
class KeyLayout:
    """The plan of one key: param placements, buckets, fragments.

    Every layout gives each param one contiguous ``space_range`` (a param's elements are back to
    back in the key space), buckets that tile the key space in order with one chunk size per
    bucket, and shards made of each rank's chunks in bucket order; which param lies where is the
    layout's choice (see Note: buckets and shards in docs/design.md).
    """

    params: tuple[int, ...]  # global param indices, in key-space order
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

    def digest(self) -> tuple:
        """What every rank must agree on (param places and buckets), for the check at
        construction that every rank planned the same layout."""
        places = tuple((i, r.start, r.end) for i, r in self.space_ranges.items())
        return places, tuple((b.space_range.start, b.chunk_numel) for b in self.buckets)


@runtime_checkable
class ShardLayout(Protocol):
    """How the params of one key are placed into buckets and cut into rank shards.

    A layout is plain data in, plain data out (no process group): it must return the same plan on
    every rank for the same arguments. ``name`` names it in messages and checkpoints' metadata.
    Implementations: ``ElementLayout`` (params back to back, every bucket split evenly: a param
    may straddle chunks) and ``WholeParamLayout`` (each param whole in one rank's chunk).
    """

    name: str

    def plan(
        self,
        params: Sequence[ParamShape],
        *,
        world_size: int,
        bucket_numel: int,
        align_numel: int,
    ) -> KeyLayout:
        """Plans one key.

        Args:
            params: (engine param index, shape) of each param, in REGISTRATION order.
            world_size: ranks sharing the key.
            bucket_numel: target bucket size in elements.
            align_numel: alignment of param starts and chunk starts, in elements.
        """
        ...


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def check_arguments(world_size: int, align_numel: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align_numel < 1:
        raise ValueError(f"align_numel must be >= 1, got {align_numel}")


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


def assemble(
    order: list[int],
    space_ranges: dict[int, Range],
    bucket_sizes: list[int],
    world_size: int,
    capacity: int,
) -> KeyLayout:
    """The KeyLayout of params placed at ``space_ranges`` (``order``: key-space order) in
    buckets of ``bucket_sizes`` elements (each a multiple of ``world_size``), back to back from
    0: members, gaps and every (bucket, rank, param) fragment; ``capacity``: the size of a full
    bucket."""
    buckets: list[Bucket] = []
    start = shard_offset = 0
    for numel in bucket_sizes:
        space = Range(start, start + numel)
        members = tuple(i for i in order if space_ranges[i].intersect(space))
        chunk = numel // world_size
        gaps = _gaps(space, members, space_ranges)
        buckets.append(Bucket(len(buckets), space, chunk, shard_offset, members, gaps))
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
        params=tuple(order),
        space_ranges=space_ranges,
        buckets=tuple(buckets),
        fragments=tuple(fragments),
        space_numel=start,
        shard_numel=shard_offset,
        bucket_numel=capacity,
    )
