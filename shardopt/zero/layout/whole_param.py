"""The whole-param layout: every param lies whole in one rank's chunk of one bucket.

Note: the whole-param plan
    For update rules that need each param whole on one rank (Muon's Newton-Schulz
    orthogonalization of each matrix). Params are taken in reverse registration order (about the
    order their grads arrive) and grouped into buckets, each at least ``bucket_numel`` elements;
    each bucket's params are spread over the ranks by a greedy longest-processing-time rule on
    ``cost(shape)``, largest cost first, each to the rank with the least cost so far *over the
    whole key* (costs carry from bucket to bucket), among the ranks whose chunk in this bucket
    still has room (a cap near the bucket's mean fill per rank, so the chunks fill evenly); and
    by best fit (largest first, each to the chunk it fills most tightly), which packs chunks
    evenly where greedy by cost cannot; of the two rules under three caps, the assignment with the
    least busiest rank within ``max_padding`` (else the least padding) is taken. Every
    rank's chunk of a bucket is padded to the bucket's fullest chunk. A bucket whose padding would
    pass ``max_padding`` of its elements takes more params (its target grows by half each try),
    so buckets hold enough params per rank to fill their chunks evenly: at large world sizes and
    with large params they grow well past ``bucket_numel`` (the report in docs/benchmarks.md,
    "Muon layout", gives their sizes); a remainder smaller than the current target joins the
    bucket before it. With ``max_padding=1`` every bucket closes as soon as it holds
    ``bucket_numel`` elements, as the element layout's do (a param larger than that ends its
    bucket, padded on the other ``world_size - 1`` ranks).
    Within a rank's chunk params keep reverse registration order; grads are still
    reduce-scattered per bucket and params all-gathered per bucket, as with ``ElementLayout``.

    Bounds. The busiest rank's cost is at least ``max(total / N, largest cost)``; where the cap
    does not bind, each param goes to the least-loaded rank, so the busiest rank is within one
    param's cost of the mean. With fewer params than ranks in a key (n < N), N - n ranks own
    nothing: the busiest rank's cost is the largest param's, at least N/n times the mean, and
    the padding is at least ``1 - total / (N * largest numel)`` of the key space. With few params
    per rank (a handful of large matrices over many ranks) the pigeonhole bounds it too: when
    some rank must hold k + 1 of the largest params and the mean is below that, neither the cost
    nor the padding can reach the mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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

#: the share of a bucket's mean fill per rank a chunk may pass before a param goes elsewhere
_CAPS = (0.0, 0.5, 1.0)


def numel_cost(shape: tuple[int, ...]) -> float:
    """The default cost of a param: its number of elements."""
    return float(numel_of(shape))


@dataclass(frozen=True)
class _Item:
    index: int
    size: int  # aligned numel
    cost: float
    position: int  # in reverse registration order


@dataclass(frozen=True)
class WholeParamLayout:
    """Each param whole in exactly one rank's chunk of one bucket, ranks balanced by ``cost``
    (see Note: the whole-param plan for the algorithm and its bounds).

    Args:
        cost: the work of one param's update as a function of its shape (default: numel). Only
            ratios matter. It must be the same function on every rank.
        max_padding: the largest share of a bucket's elements that may be padding before the
            bucket takes more params (0.05; 1.0 keeps every bucket at ``bucket_numel``).

    Example:
        >>> layout = WholeParamLayout().plan([(0, (10,)), (1, (7,)), (2, (20,))],
        ...                                  world_size=2, bucket_numel=16, align_numel=4)
        >>> [len(layout.param_fragments(i)) for i in range(3)]
        [1, 1, 1]
    """

    cost: Callable[[tuple[int, ...]], float] = numel_cost
    max_padding: float = 0.05
    name: str = "whole_param"

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_padding <= 1.0:
            raise ValueError(f"max_padding must be in [0, 1], got {self.max_padding}")

    def plan(
        self,
        params: Sequence[ParamShape],
        *,
        world_size: int,
        bucket_numel: int,
        align_numel: int,
    ) -> KeyLayout:
        check_arguments(world_size, align_numel)
        n, align = world_size, align_numel
        order = list(reversed(params))
        empty = [i for i, shape in order if numel_of(shape) == 0]
        items = [
            _Item(i, round_up(numel_of(shape), align), float(self.cost(tuple(shape))), k)
            for k, (i, shape) in enumerate(order)
            if numel_of(shape) > 0
        ]
        minimum = max(round_up(max(bucket_numel, 1), n * align) // n, align)  # per rank
        loads = [0.0] * n
        buckets: list[list[list[_Item]]] = []  # bucket -> rank -> items
        start = 0
        while start < len(items):
            target = minimum * n
            while True:
                end = _take(items, start, target)
                if sum(it.size for it in items[end:]) < target:
                    end = len(items)  # a remainder too small for a bucket joins this one
                ranks = self._assign(items[start:end], loads, align)
                chunk = max(sum(it.size for it in r) for r in ranks)
                used = sum(it.size for it in items[start:end])
                if end == len(items) or n * chunk - used <= self.max_padding * n * chunk:
                    break
                target = target * 3 // 2
            for r, mine in enumerate(ranks):
                loads[r] += sum(it.cost for it in mine)
            buckets.append(ranks)
            start = end
        space_ranges = {i: Range(0, 0) for i in empty}
        layout_order = list(empty)
        sizes, offset = [], 0
        for ranks in buckets:
            chunk = round_up(max(align, *(_fill(r) for r in ranks)), align)
            for r, mine in enumerate(ranks):
                cursor = offset + r * chunk
                for it in sorted(mine, key=lambda it: it.position):
                    numel = numel_of(order[it.position][1])
                    space_ranges[it.index] = Range(cursor, cursor + numel)
                    layout_order.append(it.index)
                    cursor += it.size
            sizes.append(n * chunk)
            offset += n * chunk
        capacity = max(sizes, default=minimum * n)
        return assemble(layout_order, space_ranges, sizes, n, capacity)

    def _assign(self, group: list[_Item], loads: list[float], align: int) -> list[list[_Item]]:
        """The ranks' params of one bucket, by two rules (least cost first, tightest fit first)
        under three chunk caps: the assignment whose busiest rank (over the key) is least among
        those within ``max_padding``, else the one with the least padding."""
        n = len(loads)
        used = sum(it.size for it in group)
        largest = max(it.size for it in group)
        mean = math.ceil(used / n)
        best, best_key = None, None
        tries = [(rule, slack) for rule in (_greedy, _best_fit) for slack in _CAPS]
        for rule, slack in tries:
            cap = max(largest, round_up(math.ceil(mean * (1 + slack * self.max_padding)), align))
            ranks = rule(group, loads, cap)
            chunk = max(_fill(r) for r in ranks)
            padding = (n * chunk - used) / (n * chunk)
            busiest = max(loads[r] + sum(it.cost for it in mine) for r, mine in enumerate(ranks))
            key = (padding > self.max_padding, busiest if padding <= self.max_padding else padding)
            if best_key is None or key < best_key:
                best, best_key = ranks, key
        return best


def _fill(items: list[_Item]) -> int:
    return sum(it.size for it in items)


def _take(items: list[_Item], start: int, target: int) -> int:
    """The end of the shortest run of ``items`` from ``start`` of at least ``target`` elements
    (or the end of ``items``)."""
    total, end = 0, start
    while end < len(items) and total < target:
        total += items[end].size
        end += 1
    return end


def _greedy(group: list[_Item], loads: list[float], cap: int) -> list[list[_Item]]:
    """Largest cost first, each to the least-loaded rank whose chunk has room under ``cap``
    (none has: the emptiest chunk)."""
    n = len(loads)
    cost = list(loads)
    fill = [0] * n
    ranks: list[list[_Item]] = [[] for _ in range(n)]
    for it in sorted(group, key=lambda it: (-it.cost, -it.size, it.position)):
        room = [r for r in range(n) if fill[r] + it.size <= cap]
        if room:
            r = min(room, key=lambda r: (cost[r], fill[r], r))
        else:
            r = min(range(n), key=lambda r: (fill[r], cost[r], r))
        ranks[r].append(it)
        cost[r] += it.cost
        fill[r] += it.size
    return ranks


def _best_fit(group: list[_Item], loads: list[float], cap: int) -> list[list[_Item]]:
    """Largest first, each to the rank whose chunk it leaves the least room in under ``cap``
    (ties: the least-loaded; none has room: the emptiest chunk): fills chunks evenly where
    the params' sizes allow it."""
    n = len(loads)
    cost = list(loads)
    fill = [0] * n
    ranks: list[list[_Item]] = [[] for _ in range(n)]
    for it in sorted(group, key=lambda it: (-it.size, -it.cost, it.position)):
        room = [r for r in range(n) if fill[r] + it.size <= cap]
        if room:
            r = min(room, key=lambda r: (cap - fill[r] - it.size, cost[r], r))
        else:
            r = min(range(n), key=lambda r: (fill[r], cost[r], r))
        ranks[r].append(it)
        cost[r] += it.cost
        fill[r] += it.size
    return ranks
