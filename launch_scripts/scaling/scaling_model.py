"""Step-time model of DistributedFusedAdam training, from 1 to 1,024 GPUs (docs/scaling.md).

The step time per GPU of weak-scaled data-parallel training (a fixed batch per GPU) as a function
of model size, world size, GPUs per node, bucket size and link bandwidths, assembled from parts
measured on 2 x H200 (docs/benchmarks.md, commit 7d95db8) and a few stated assumptions:

    step = compute + exposed reduce-scatter + optimizer kernel + exposed all-gather
           + contention (overlapped collectives slowing the compute) + HSDP all-reduce

- compute: forward + backward at 8 x 1024 tokens per GPU; for the 1.4B GPT it is derived from the
  no-overlap row (step minus its exposed reduce-scatters minus its optimizer step), for other
  models scaled by training FLOPs per token (same achieved FLOP rate);
- optimizer kernel: bytes per param / (share of copy bandwidth x copy bandwidth), on this GPU's
  shard (docs/benchmarks.md kernel rows);
- collectives: ring alpha-beta, ``t = alpha + steps x latency + bus bytes / bus bandwidth``;
  alpha and the NVLink bus bandwidth fitted on the single-call rows of the 2-GPU collective
  table, per-step latencies and the network (bandwidth, efficiency) assumed; a ring across nodes
  is bounded by
  NVLink ((G-1)/G of each GPU's bytes) and by the G NICs of a node (1/G of its bytes each);
- overlap: reduce-scatters queue behind backward (buckets ready in proportion to their bytes over
  2/3 of the compute), all-gathers ahead of forward (the last 1/3); what does not fit is exposed;
- contention: overlapped collectives cost kappa x (their bus bytes / NVLink bus bandwidth) of
  compute; kappa is fitted on the overlap row (100 MB buckets, first run);
- HSDP (shard within a node of G GPUs, replicate across the N/G nodes): reduce-scatter and
  all-gather stay in the node, and after backward each GPU all-reduces its 1/G grad shard over its
  own NIC with the same GPU of every other node: a ring of N/G, exposed (the engine runs it after
  the last reduce-scatter, before the update).

    python launch_scripts/scaling/scaling_model.py               # checks, tables, recommendation
    python launch_scripts/scaling/scaling_model.py --write-docs  # also docs/scaling.md + the plot
    python launch_scripts/scaling/scaling_model.py --model 7b --gpus 256 --hsdp --bucket-mb 1600

The parts: scaling_inputs.py (measurements, shapes, machine, layout), scaling_step.py (the model),
scaling_calibration.py (fits and checks), scaling_report.py (tables, docs, plot); this file is the
command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from scaling_calibration import Calibration, calibrate, check_rows
from scaling_inputs import BEGIN, DOC, END, MODELS, PLOT, REPO, Layout, Machine
from scaling_report import efficiency, plot, render, write_docs
from scaling_step import bucket_sizes, optimizer_ms, predict, queue_ahead, queue_behind, ring_ms

# the model's parts, for callers of this module (tests/scripts/test_scaling_model.py)
__all__ = [
    "BEGIN",
    "END",
    "MODELS",
    "Calibration",
    "Layout",
    "Machine",
    "bucket_sizes",
    "calibrate",
    "check_rows",
    "main",
    "optimizer_ms",
    "predict",
    "queue_ahead",
    "queue_behind",
    "render",
    "ring_ms",
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--net-gbps", type=float, default=400.0, help="NIC line rate per GPU, Gb/s")
    p.add_argument("--net-eff", type=float, default=0.9, help="share of the line rate reached")
    p.add_argument("--lat-net-us", type=float, default=10.0, help="per ring step across nodes")
    p.add_argument("--lat-intra-us", type=float, default=3.0, help="per ring step in a node")
    p.add_argument(
        "--compute-ms", type=float, default=None,
        help="1.4B forward + backward, ms (default: derived from the no-overlap row)",
    )  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), help="print one prediction (with --gpus)")
    p.add_argument("--gpus", type=int, help="GPUs for one prediction")
    p.add_argument("--hsdp", action="store_true", help="one prediction with HSDP")
    p.add_argument("--bucket-mb", type=float, default=100.0, help="for one prediction")
    p.add_argument("--write-docs", action="store_true", help=f"rewrite {DOC.name}'s block + plot")
    args = p.parse_args(argv)
    base = Machine(
        net_gbps=args.net_gbps, net_eff=args.net_eff, lat_net_us=args.lat_net_us,
        lat_intra_us=args.lat_intra_us,
    )  # fmt: skip
    cal = calibrate(base, args.compute_ms)
    if args.model:
        shape = MODELS[args.model]
        lay = Layout(args.gpus or 2, args.gpus_per_node, args.hsdp, args.bucket_mb)
        eff, step = efficiency(shape, lay, cal)
        for name, value in dataclasses.asdict(step).items():
            print(f"{name:>15}: {value:8.2f} ms")
        print(f"{'step':>15}: {step.total:8.2f} ms | efficiency {eff:.1%}")
        return
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-docs"]
    text = render(cal, base, args.gpus_per_node, "".join(f" {a}" for a in flags))
    print(text)
    if args.write_docs:
        write_docs(text, DOC)
        plot(cal, args.gpus_per_node, PLOT)
        print(f"wrote {DOC.relative_to(REPO)} and {PLOT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
