"""The element-wise layout: params back to back, every bucket split evenly over the ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardopt.zero.layout.plan import (
    KeyLayout,
    ParamShape,
    Range,
    assemble,
    check_arguments,
    numel_of,
    round_up,
)


def plan_key(
    params: list[tuple[int, int]],
    *,
    world_size: int,
    bucket_numel: int,
    align_numel: int,
) -> KeyLayout:
    """Plans one key element-wise (``ElementLayout``'s plan, by numel).

    Within the key, params lie back to back in reverse registration order (about the order their
    grads arrive), each start aligned to ``align_numel``. The key space is cut into buckets of
    ``bucket_numel`` elements (rounded up to whole aligned chunks; the last one shorter), each
    padded to divide by ``world_size``; rank r owns chunk r of every bucket, so a param may
    straddle chunks and buckets.

    Args:
        params: (global param index, numel) in REGISTRATION order; laid out reversed.
        world_size: ranks sharing the key.
        bucket_numel: target bucket size in elements (rounded up to whole aligned chunks).
        align_numel: alignment of param starts and chunk starts, in elements.

    Returns:
        The key's layout.
    """
    check_arguments(world_size, align_numel)
    unit = world_size * align_numel
    bucket_numel = max(round_up(max(bucket_numel, 1), unit), unit)
    order = list(reversed(params))
    space_ranges: dict[int, Range] = {}
    offset = 0
    for index, numel in order:
        offset = round_up(offset, align_numel)
        space_ranges[index] = Range(offset, offset + numel)
        offset += numel
    sizes, start = [], 0
    while start < offset:
        sizes.append(min(bucket_numel, round_up(offset - start, unit)))
        start += sizes[-1]
    return assemble([i for i, _ in order], space_ranges, sizes, world_size, bucket_numel)


@dataclass(frozen=True)
class ElementLayout:
    """Today's ZeRO layout: params back to back in reverse registration order, each bucket cut
    into ``world_size`` equal chunks (a param may straddle chunks and buckets; no padding beyond
    alignment and the last bucket's). See ``plan_key``.

    Example:
        >>> layout = ElementLayout().plan([(0, (10,)), (1, (7,))], world_size=2,
        ...                               bucket_numel=16, align_numel=4)
        >>> layout.params
        (1, 0)
    """

    name: str = "element"

    def plan(
        self,
        params: Sequence[ParamShape],
        *,
        world_size: int,
        bucket_numel: int,
        align_numel: int,
    ) -> KeyLayout:
        return plan_key(
            [(i, numel_of(shape)) for i, shape in params],
            world_size=world_size,
            bucket_numel=bucket_numel,
            align_numel=align_numel,
        )
