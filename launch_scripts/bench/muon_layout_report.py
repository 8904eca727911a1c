"""The whole-param shard layout on Muon's matrices, computed on the CPU (pure data, seconds).

For the 124M and 1.3B GPT sets (fused qkv, launch_scripts/train/gpt.py's shapes) and Llama-3-8B's
decoder matrices (GQA: 8 kv heads of 128), planned by ``WholeParamLayout(cost=ns_cost)`` at world
sizes 2-64 and two bucket sizes (fp32 grads): the busiest rank's Newton-Schulz cost over the mean
(and the least any layout can give: the largest matrix's cost over the mean, or 1), the padding
as a share of the grad-sync bytes (every bucket's elements, which the reduce-scatter and the
all-gather move), the buckets and the collectives per step (one reduce-scatter and one all-gather
per bucket; the element layout's count for the same cap beside it), the largest bucket, and the
padding of buckets kept at the cap (``max_padding=1``, Megatron's choice: pay padding instead).

    python launch_scripts/bench/muon_layout_report.py [--buckets-mb 25 100]
"""

from __future__ import annotations

import argparse
import time

from shardopt.algorithms.muon import ns_cost
from shardopt.zero.layout import ElementLayout, WholeParamLayout

WORLDS = (2, 4, 8, 16, 32, 64)
ALIGN = 32  # 128 bytes of fp32 (the engine's ALIGN_BYTES)
MIB = 2**20


def gpt(d: int, layers: int) -> list[tuple[int, ...]]:
    """The Muon matrices of launch_scripts/train/gpt.py's GPT, registration order."""
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def llama(d: int = 4096, layers: int = 32, ffn: int = 14336, kv: int = 8 * 128) -> list:
    """Llama decoder matrices: q, k, v, o, gate, up, down per layer, registration order."""
    one = ((d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn))
    return [s for _ in range(layers) for s in one]


SETS = {
    "GPT 124M": gpt(768, 12),
    "GPT 1.3B": gpt(2048, 24),
    "Llama 8B": llama(),
}


def row(shapes: list, world: int, bucket_mb: float) -> dict:
    params = list(enumerate(shapes))
    bucket_numel = int(bucket_mb * MIB) // 4
    args = dict(world_size=world, bucket_numel=bucket_numel, align_numel=ALIGN)
    layout = WholeParamLayout(cost=ns_cost).plan(params, **args)
    element = ElementLayout().plan(params, **args)
    costs = [ns_cost(s) for s in shapes]
    load = [0.0] * world
    for f in layout.fragments:
        load[f.rank] += costs[f.param]
    mean = sum(costs) / world
    return {
        "busiest": max(load) / mean,
        "bound": _bound(costs, world) / mean,
        "fixed": _padding(WholeParamLayout(cost=ns_cost, max_padding=1.0).plan(params, **args)),
        "padding": _padding(layout),
        "buckets": len(layout.buckets),
        "collectives": 2 * len(layout.buckets),
        "element": 2 * len(element.buckets),
        "largest": max(b.numel for b in layout.buckets) * 4 / MIB,
    }


def _bound(costs: list[float], world: int) -> float:
    """The least busiest-rank cost any placement of whole matrices can give: the mean, the
    largest matrix, and (more matrices than ranks) two of the world + 1 largest on one rank."""
    c = sorted(costs, reverse=True)
    pair = c[world - 1] + c[world] if len(c) > world else 0.0
    return max(sum(c) / world, c[0], pair)


def _padding(layout) -> float:
    """Padding, % of the grad-sync elements (every bucket's)."""
    used = sum(r.numel for r in layout.space_ranges.values())
    return 100.0 * (layout.space_numel - used) / layout.space_numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[25.0, 100.0])
    args = parser.parse_args()
    start = time.perf_counter()
    print(
        "| set | matrices | world | bucket MiB | busiest / mean NS cost (bound) | padding % "
        "| buckets | collectives / step (element) | largest bucket MiB | padding % at "
        "max_padding=1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, shapes in SETS.items():
        for bucket_mb in args.buckets_mb:
            for world in WORLDS:
                r = row(shapes, world, bucket_mb)
                print(
                    f"| {name} | {len(shapes)} | {world} | {bucket_mb:g} | {r['busiest']:.3f} "
                    f"({r['bound']:.3f}) | {r['padding']:.2f} | {r['buckets']} | "
                    f"{r['collectives']} ({r['element']}) | {r['largest']:.0f} | {r['fixed']:.1f} |"
                )
    print(f"\ncomputed on the CPU in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
