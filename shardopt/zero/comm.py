"""The only module of shardopt.zero that calls torch.distributed.

Wraps the collectives the engine needs (reduce-scatter, all-gather, all-reduce, broadcast) with
the process-group plumbing and the backend quirks: NCCL needs CUDA tensors and gathers in place;
gloo gets a separate input buffer for all-gather (its input may not alias the output).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
_log = logging.getLogger("shardopt")

#: seconds a rank waits in ``arrive`` for the others (0 turns the check off)
ARRIVAL_TIMEOUT_ENV = "SHARDOPT_ARRIVAL_TIMEOUT"
DEFAULT_ARRIVAL_TIMEOUT = 30.0

# torch 2.13 renamed the tensor collectives (*_single); older releases only have *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def require_initialized(owner: str) -> None:
    """torch.distributed initialised, or, in a single process (no launcher's ``WORLD_SIZE``
    above 1), a world of one started here, as DeepSpeed does for ``python train.py``: a
    distributed optimizer then runs in one process (CPU offload on one GPU) with no launcher and
    no ``init_process_group`` of the user's. Launched processes must initialise themselves."""
    if not dist.is_available():
        raise RuntimeError(f"{owner} needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            f"{owner} needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment; use backend 'nccl' on GPUs, 'gloo' on CPU)"
        )
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _log.info("%s: no process group: started a world of one process (%s)", owner, backend)


def rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def world_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def backend(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def device_backend(group: ProcessGroup | None, device: torch.device):
    """The backend object (e.g. ``ProcessGroupNCCL``) serving ``group`` on ``device``'s type."""
    whole = group if group is not None else dist.group.WORLD
    return whole._get_backend(torch.device(device.type))


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class Handle:
    """An in-flight collective; ``wait()`` is idempotent."""

    def __init__(self, work: dist.Work | None, after=None) -> None:
        self._work = work
        self._after = after

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._after is not None:
            after, self._after = self._after, None
            after()


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = True
) -> Handle:
    """SUM reduce-scatter of ``input`` (world_size equal chunks) into ``output``; the handle keeps
    both alive until it is waited on."""
    work = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Handle(work, after=lambda: (output, input))


def all_gather(
    output: torch.Tensor, chunk: torch.Tensor, group: ProcessGroup | None, async_op: bool = True
) -> Handle:
    """Gathers every rank's ``chunk`` into ``output``; ``chunk`` may be this rank's slice of it."""
    if (
        backend(group) != "nccl"
        and chunk.data_ptr() >= output.data_ptr()
        and (chunk.data_ptr() < output.data_ptr() + output.numel() * output.element_size())
    ):
        chunk = chunk.clone()
    work = _all_gather(output, chunk, group=group, async_op=async_op)
    keep_alive = chunk
    return Handle(work, after=lambda: keep_alive)


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum", async_op: bool = False
) -> Handle:
    """In-place all-reduce with op "sum" or "max"."""
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    return Handle(dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op))


def broadcast(tensors: Sequence[torch.Tensor], src_group_rank: int, group: ProcessGroup | None):
    """Broadcasts tensors in place from group rank ``src_group_rank``."""
    src = global_rank(group, src_group_rank)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def all_gather_object(obj, group: ProcessGroup | None) -> list:
    out: list = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier() -> None:
    """A barrier over every process (checkpoint publication)."""
    dist.barrier()


def raise_if_any(error: Exception | None, group: ProcessGroup | None) -> None:
    """Collective: re-raises ``error`` here, and on every other rank raises the same type naming
    the first rank that failed (so a check that fails on one rank never hangs the others)."""
    gather_checked(error, None, group)


def gather_checked(error: Exception | None, payload, group: ProcessGroup | None) -> list:
    """Collective: ``raise_if_any(error)``, and every rank's ``payload`` when no rank failed (one
    all-gather serves a local check and a comparison across ranks)."""
    everyone = all_gather_object(
        (None if error is None else (type(error), str(error)), payload), group
    )
    if error is not None:
        raise error
    for r, (e, _) in enumerate(everyone):
        if e is not None:
            kind, message = e
            raise kind(f"rank {r} failed: {message}")
    return [p for _, p in everyone]


# -- arrival at collective calls (see Note: arrival check) ----------------------------------------

_arrivals: dict[tuple[str, str], int] = {}  # (group name, call) -> calls entered so far


class CollectiveCallError(RuntimeError):
    """A collective call that not every rank of its group made."""


def arrival_timeout() -> float:
    value = os.environ.get(ARRIVAL_TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_ARRIVAL_TIMEOUT
    except ValueError:
        raise ValueError(
            f"{ARRIVAL_TIMEOUT_ENV} must be a number of seconds, got {value!r}"
        ) from None


def arrive(call: str, group: ProcessGroup | None) -> None:
    """Waits until every rank of ``group`` entered this collective ``call`` (its n-th time);
    raises ``CollectiveCallError`` naming the call and the ranks missing when they do not
    within ``SHARDOPT_ARRIVAL_TIMEOUT`` seconds, or at once when one of them waits in another
    collective call.

    Note: arrival check. A collective such as ``state_dict()`` called on one rank only (under
    ``if rank == 0``) would wait in its first collective until the backend's timeout (30
    minutes on gloo). Before its first collective each such entry point registers in the
    group's store (which every backend has): a counter per call name and count, polled with
    backoff (one small request per poll, whatever the world size), the list of ranks that
    arrived and, per rank, the call it waits in, read only every few seconds and for the
    ranks missing. A few store round trips per checkpoint-level call, none per step. A rank
    that gives up withdraws from the counter, so the counts stay aligned if it goes on.
    """
    world = world_size(group)
    timeout = arrival_timeout()
    if world == 1 or timeout <= 0:
        return
    pg = group if group is not None else dist.group.WORLD
    store = pg.get_group_store()
    me = rank(group)
    name = (pg.group_name, call)
    count = _arrivals[name] = _arrivals.get(name, 0) + 1
    base = f"shardopt/arrive/{call}/{count}"
    where = f"shardopt/at/{{}}/{pg.group_name}"
    store.set(where.format(me), f"{call} #{count}")
    store.append(f"{base}/ranks", f"{me},")
    arrived = store.add(base, 1)
    if count > 2:  # every rank has left call count-2 once this rank could enter count-1
        store.delete_key(f"shardopt/arrive/{call}/{count - 2}")
        store.delete_key(f"shardopt/arrive/{call}/{count - 2}/ranks")
    start = time.monotonic()
    deadline, next_look, delay = start + timeout, start + 2.0, 0.001
    while arrived < world:
        now = time.monotonic()
        if now >= next_look or now >= deadline:
            next_look = now + 2.0
            listed = store.get(f"{base}/ranks").decode().split(",")
            missing = sorted(set(range(world)) - {int(r) for r in listed if r})
            places = {r: _place(store, where.format(r)) for r in missing}
            elsewhere = any(c and c != f"{call} #{count}" for c in places.values())
            if now >= deadline or elsewhere:
                if store.add(base, -1) == world - 1:  # the last one arrived just now: go on
                    store.add(base, 1)
                    break
                # withdrawn; the others see where this rank was
                store.set(where.format(me), f"{call} #{count}, which it left with this error")
                _arrivals[name] = count - 1
                raise CollectiveCallError(
                    _arrival_message(call, me, world, missing, places, timeout, elsewhere)
                )
        time.sleep(delay)
        delay = min(2 * delay, 0.1)
        arrived = store.add(base, 0)
    store.set(where.format(me), "")


def _place(store, key: str) -> str:
    """The collective call a rank is waiting in ("" if none)."""
    return store.get(key).decode() if store.check([key]) else ""


def _arrival_message(call, me, world, missing, places, timeout, elsewhere) -> str:
    others = ", ".join(
        f"rank {r} (in {places[r]})" if places.get(r) else f"rank {r}" for r in missing
    )
    when = "" if elsewhere else f" within {timeout:g}s"
    return (
        f"{call} is collective: every rank of the process group must call it, but rank {me} "
        f"called it and {others} of {world} did not{when}. Call it on every rank (not under "
        f"`if rank == 0`); set {ARRIVAL_TIMEOUT_ENV} (seconds) if a rank is legitimately "
        "slower to get there"
    )
