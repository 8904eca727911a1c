"""CPU offload at construction: the fraction every rank starts with, the thread budget, the plan.

``fraction="auto"`` starts here with what must be offloaded: the share of this rank's state that
does not fit in the free GPU memory (none on a CPU job, where the device is the host). The
backward has not run yet, so the window the CPU update could hide in is unknown; the fraction is
picked from measured times after the first steps and applied once at a step boundary
(offload_replan.py, Note: what auto measures). Rank 0 decides; every rank takes its decision
(the key split must be the same everywhere; with HSDP, the first replica's). ``attach`` gives a
built optimizer its plan, its pipeline and, for auto, the timer of its first steps.

Note: offload is visible. A user must see that offload is on without configuring logging, and
a configured run must not get lines it did not ask for. So rank 0 announces each optimizer's
plan once, at construction: at INFO on the ``shardopt`` logger (``fraction="auto"``: its
decision after the first steps, offload_replan.py), and, only where logging is not configured
at all (``logging.getLogger("shardopt").hasHandlers()`` is false: no handler on it or above
it), one line to stderr naming what is offloaded and how to see more. ``print(opt.offload_plan)``
(``OffloadPlan.__str__``) gives the whole plan in one line, on any rank (docs/offload.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator

import torch

from shardopt import kernels as _ops
from shardopt.zero import comm
from shardopt.zero.offload import (
    host_memory,
    host_numa,
    host_state,
)
from shardopt.zero.offload import (
    measure as offload_measure,
)
from shardopt.zero.offload import (
    pipeline as offload_pipeline,
)
from shardopt.zero.offload import (
    replan as offload_replan,
)
from shardopt.zero.offload.host_numa import Placement
from shardopt.zero.offload.plan import (
    CPUOffload,
    OffloadPlan,
    floor_fraction,
    local_ranks,
    thread_budget,
)
from shardopt.zero.offload.replan import at_boundary  # noqa: F401  (the engine's step boundary)
from shardopt.zero.state_storage import Storage

logger = logging.getLogger("shardopt")

#: the ``CPUOffload`` fields every rank must agree on, since collectives depend on them:
#: ``fraction`` splits the keys (and ``"auto"`` runs collectives of its own, here and at the
#: re-plan), ``overlap_backward`` decides which buckets start their update during backward and
#: the step's check of it; the other fields only tune this host's update and may differ
AGREED_FIELDS = ("fraction", "overlap_backward")


def agree(
    owner: str,
    error: Exception | None,
    settings: CPUOffload | None,
    process_group: comm.ProcessGroup | None,
    redundant_process_group: comm.ProcessGroup | None,
) -> None:
    """Collective, at construction before any collective that depends on the offload settings:
    raises ``error`` (a setting this rank refused) on every rank, as ``comm.raise_if_any`` does,
    else a ValueError on every rank naming each of ``AGREED_FIELDS`` (or offload itself) that
    differs between ranks. With HSDP the replicas are compared too (each rank sees every
    rank's settings, so no rank goes on to a collective another skips)."""
    mine = None if settings is None else tuple(getattr(settings, f) for f in AGREED_FIELDS)
    everyone = _everywhere(error, mine, process_group, redundant_process_group)
    first, _, theirs = everyone[0]
    diffs = []
    for rank, _, other in everyone[1:]:
        if (theirs is None) != (other is None):
            on = {True: "CPU offload", False: "no offload"}
            diffs.append(
                f"offload: rank {first} has {on[theirs is not None]}, rank {rank} has "
                f"{on[other is not None]}"
            )
        elif theirs is not None:
            diffs.extend(
                f"CPUOffload.{name}: rank {first} has {a!r}, rank {rank} has {b!r}"
                for name, a, b in zip(AGREED_FIELDS, theirs, other)
                if a != b
            )
    if diffs:
        raise ValueError(
            f"{owner}: CPU offload settings differ between ranks (they must be equal on every "
            "rank: the key split and the collectives depend on them): " + "; ".join(diffs[:5])
        )


def _everywhere(
    error: Exception | None,
    payload,
    process_group: comm.ProcessGroup | None,
    redundant_process_group: comm.ProcessGroup | None,
) -> list[tuple]:
    """Collective over the process group and, with HSDP, the replicas: raises ``error`` here
    and the same type naming the first rank that failed on every other rank; else every rank's
    (global rank, None, ``payload``), by rank."""
    me = comm.global_rank(process_group, comm.rank(process_group))
    failed = None if error is None else (type(error), str(error))
    everyone = comm.all_gather_object((me, failed, payload), process_group)
    if redundant_process_group is not None:
        parts = comm.all_gather_object(everyone, redundant_process_group)
        everyone = sorted({entry[0]: entry for part in parts for entry in part}.values())
    if error is not None:
        raise error
    for rank, e, _ in everyone:
        if e is not None:
            kind, message = e
            raise kind(f"rank {rank} failed: {message}")
    return everyone


def agreed_fraction(
    optimizer,
    settings: CPUOffload | None,
    storage: Storage | None,
    process_group: comm.ProcessGroup | None,
) -> float | None:
    """The fraction of every key to offload at construction (the same on every rank), None
    without offload; sets the update's thread budget."""
    if settings is None:
        return None
    optimizer._offload_threads = thread_budget(settings.threads)
    placement = optimizer._offload_placement
    if placement is not None and settings.threads is None:  # the node's CPUs, not the host's
        optimizer._offload_threads = min(optimizer._offload_threads, placement.threads)
    optimizer._offload_reason = f"fraction={settings.fraction} as requested"
    optimizer._offload_measurements = {}
    if settings.fraction != "auto":
        return float(settings.fraction)
    decision: tuple | Exception | None = None
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if comm.rank(process_group) == 0 and params:
        try:  # a failure here must fail every rank, not leave them waiting below
            offload_replan.injected()  # a bad value is named now, not at the re-plan
            device = _ops.common_device(params, "params")
            numel = -(-sum(p.numel() for p in params) // comm.world_size(process_group))
            need = numel * offload_measure.state_bytes_per_param(optimizer, params, storage)
            free = float(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else math.inf
            fraction = floor_fraction(need, free)
            reason = (
                f"auto at construction: state {need / 2**30:.2f} GiB vs "
                f"{free / 2**30:.2f} GiB free on the device, offload {fraction:.3f} until the "
                f"first {offload_replan.MEASURED_STEPS} steps are timed"
            )
            found = {"free_bytes": free} if math.isfinite(free) else {}
            decision = (fraction, reason, found)
        except ValueError as e:
            decision = ValueError(f"{type(optimizer).__name__}: offload fraction='auto': {e}")
        except RuntimeError as e:
            decision = RuntimeError(
                f"{type(optimizer).__name__}: offload fraction='auto' could not measure: {e}"
            )
    elif comm.rank(process_group) == 0:
        decision = (1.0, "auto: no trainable params", {})
    decision = comm.all_gather_object(decision, process_group)[0]
    redundant = optimizer.redundant_process_group
    if redundant is not None:  # HSDP: every replica takes the first one's split
        decision = comm.all_gather_object(decision, redundant)[0]
    if isinstance(decision, Exception):
        raise type(decision)(str(decision))
    fraction, reason, found = decision
    optimizer._offload_reason, optimizer._offload_measurements = reason, found
    return fraction


def numa_placement(owner: str, settings: CPUOffload | None, param_groups) -> Placement | None:
    """Where the host state and the update go on a host with several NUMA nodes (Note: NUMA
    placement in host_numa.py); raises ValueError naming ``owner`` for a node it cannot use."""
    if settings is None or settings.numa_node is None:
        return None
    params = [p for g in param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    try:
        return host_numa.placement(settings.numa_node, device, local_ranks())
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None


@contextlib.contextmanager
def first_touch(optimizer, settings: CPUOffload | None) -> Iterator[None]:
    """The context the host state is allocated in: the update's thread budget, so the zero fill
    is parallel, and the NUMA node its pages are preferred on, if placed (Note: NUMA placement
    in host_numa.py). Collective with offload: a host allocation that failed on one rank
    (``host_memory.HostMemoryError``) raises on every rank, none going on to a collective the
    failed one skips."""
    if settings is None:
        yield
        return
    placement = optimizer._offload_placement
    node = placement.node if placement is not None else None
    error = None
    with host_state.threads(optimizer._offload_threads), host_memory.on_node(node):
        try:
            yield
        except host_memory.HostMemoryError as e:
            error = e
    _everywhere(error, None, optimizer.process_group, optimizer.redundant_process_group)


def record(optimizer, settings: CPUOffload | None, fraction: float | None) -> OffloadPlan | None:
    """The plan of a built optimizer (its keys exist), logged once."""
    if settings is None:
        return None
    host = [k for k in optimizer.keys if k.buffers.offloaded]
    device = [k for k in optimizer.keys if not k.buffers.offloaded]

    def count(keys: list, what: str) -> int:
        if what == "params":
            return sum(len(k.layout.params) for k in keys)
        return sum(k.layout.shard_numel for k in keys)

    saved = 0  # host state that would be on the GPU (a param key's host master copies params)
    for key in host:
        for what, n in key.buffers.bytes("host").items():
            if what != "master" or key.buffers.master_kind == "copy":
                saved += n
    plan = OffloadPlan(
        fraction=float(fraction),
        requested=settings.fraction,
        reason=optimizer._offload_reason,
        threads=optimizer._offload_threads,
        host_params=count(host, "params"),
        device_params=count(device, "params"),
        host_numel=count(host, "numel"),
        device_numel=count(device, "numel"),
        measurements=dict(optimizer._offload_measurements),
        device_bytes_saved=saved,
        numa_node=optimizer._offload_placement.node if optimizer._offload_placement else None,
    )
    if optimizer.rank == 0 and not getattr(optimizer, "_offload_announced", False):
        announce(type(optimizer).__name__, plan)  # (not again at a re-plan's rebuild)
        optimizer._offload_announced = True
    return plan


def announce(owner: str, plan: OffloadPlan) -> None:
    """Rank 0, once per optimizer (see Note: offload is visible): the plan at INFO on the
    ``shardopt`` logger, except ``"auto"``'s, logged when it is decided (offload_replan.py); and
    where no logging is configured (no handler on the logger or above it), one line to stderr."""
    if plan.requested != "auto":
        logger.info("%s: %s", owner, plan)
    if not logger.hasHandlers():
        what = (
            f"fraction='auto', {plan.fraction:.3f} of this rank's shard on the host until the "
            f"first {offload_replan.MEASURED_STEPS} steps are timed, then re-planned once"
            if plan.requested == "auto"
            else f"{plan.host_params} params on the host, {plan.device_params} on the GPU, "
            f"{plan.threads} update threads, {plan.device_bytes_saved / 2**20:.1f} MiB of GPU "
            "memory saved"
        )
        print(
            f"shardopt: {owner}: CPU offload is on ({what}); print(optimizer.offload_plan) for "
            "details. (Shown because logging is not configured: configure the 'shardopt' logger "
            "to route or silence this line.)",
            file=sys.stderr,
        )


def attach(optimizer, settings: CPUOffload | None) -> None:
    """A built optimizer's ``_offload_plan`` and ``_offload_pipeline`` (None without offload);
    with ``fraction="auto"``, the timer of its first steps (offload_replan.install)."""
    optimizer._offload_plan = record(optimizer, settings, optimizer.config.offload_fraction)
    with first_touch(optimizer, settings):  # the staging slots
        optimizer._offload_pipeline = offload_pipeline.OffloadPipeline.of(optimizer, settings)
    if settings is not None and settings.fraction == "auto":
        offload_replan.install(optimizer)
