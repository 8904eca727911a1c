"""CPU offload settings and the plan of what is offloaded: pure data, no torch.distributed.

``CPUOffload`` is what users pass (``offload="cpu"`` is ``CPUOffload()``). ``resolve`` checks it;
``split_params`` cuts a key's params into the part whose masters, state and update live on the
host and the part that stays on the GPU; ``plan_fraction`` is the ``fraction="auto"`` decision as
a pure function of measured speeds (milliseconds and bytes), so it is tested as data (the
measurements are taken in offload_auto.py and offload_replan.py).

Note: which params stay on the GPU
    Within a key params are laid out in reverse registration order (layout.py), so backward
    produces the last-registered params first and the next forward needs the first-registered
    params first. ``fraction`` of the key's elements, taken from the last-registered params, is
    offloaded: their reduce-scatters finish first (their CPU update can start earliest) and their
    all-gathers are needed last. The first-registered params (``1 - fraction``) keep the GPU
    path. A split key becomes two keys (host part first, so the launch order of the
    reduce-scatters stays the order grads arrive); ``fraction=1`` keeps every key whole, so its
    layout and results are those of the same optimizer without offload, bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

#: the offloaded share of a key is rounded to whole params; a param is never split between the
#: host and the GPU
Fraction = float | Literal["auto"]
#: the most staging slots per direction (see ``CPUOffload.staging_slots``)
MAX_STAGING_SLOTS = 16


def max_threads() -> int:
    """The most update threads ``CPUOffload.threads`` may ask for: the CPUs this process may
    use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CPUOffload:
    """Keep this rank's shard of masters and optimizer state in host memory; update it there.

    Args:
        fraction: share of this rank's shard (in elements, rounded to whole params) whose state
            and update live on the CPU, in [0, 1]; the rest (the params backward produces last,
            which the next forward needs first) keep the GPU path. ``"auto"``: at construction
            only what does not fit in the free GPU memory; after the first steps, the fraction
            picked from the measured backward (and forward) time, CPU update speed,
            host-device copy speed and free GPU memory, applied once at a step boundary (see
            docs/offload.md); the choice and its reason are logged once (``shardopt`` logger)
            and kept in ``optimizer.offload_plan``.
        pin_memory: stage grads and updated params through page-locked host buffers of exact
            size (CUDA jobs; the state itself is never pinned).
        threads: CPU threads for the update (torch intra-op threads of this process); None:
            the cores this process may use, split evenly among the local ranks
            (``LOCAL_WORLD_SIZE``), less one for the rank's own thread where a rank has four or
            more (it launches the forward and backward the update overlaps). At most the
            CPUs this process may use (``max_threads()``): the update is bound by DRAM
            bandwidth, and more threads than cores only time-slice them (slower: see
            docs/offload.md).
        staging_slots: page-locked staging buffers per direction (each the size of the largest
            bucket chunk), at most ``MAX_STAGING_SLOTS`` (16): the worker keeps at most one
            bucket queued behind the one it updates, so more slots only hold host memory (each
            a bucket chunk, allocated at construction).
        overlap_backward: start an offloaded bucket's CPU update during backward, as soon as
            its reduce-scatter is done (Adam, SGD, Adagrad; every param of the bucket must have a
            grad on this rank). Exact only without clipping, GradScaler or a second
            synchronised backward per step; an iteration with it on that does one of those
            raises. ``False`` (the default): never, the update starts in ``step()``;
            ``"auto"``: on from the second step when the previous step did none of those;
            ``True``: from the first step (see docs/offload.md).
        huge_pages: allocate the host state and staging buffers of 2 MiB or more advised as
            transparent huge pages (``MADV_HUGEPAGE``; a no-op where the OS has them off), their
            starts staggered: fewer TLB misses for the DRAM-bound update. Off by default until
            it is measured faster end to end (Note: huge pages for host state in
            shardopt/zero/offload/host_memory.py says what was measured). The values do not
            depend on it.
        switch_interval: seconds; while an offload worker thread runs, the interpreter's thread
            switch interval (``sys.setswitchinterval``) is lowered to this when it is larger, and
            put back when the last worker stops. The worker takes the GIL back after every
            kernel and copy call, and with Python's default (0.005 s) it can wait that long each
            time the training loop holds the GIL, with the update's threads idle (see Note: the
            worker and the GIL in shardopt/zero/offload/worker.py). None: leave it as it is.
        numa_node: on a host with several NUMA nodes, the node whose memory holds the host
            state and whose CPUs run the update. ``"auto"``: the CUDA device's node, when there
            are at least as many local ranks as nodes with CPUs (else, and on a host with one
            node, nothing is placed); an int: that node; None: no placement (see Note: NUMA
            placement in shardopt/zero/offload/host_numa.py). The values do not depend on it.

    Raises:
        TypeError, ValueError: at construction, naming a field of a wrong type or out of
            range; ``threads`` above the CPUs this process may use raises when the optimizer
            is built (on every rank: the bound depends on the host).

    Example::

        offload = shardopt.CPUOffload(fraction=0.5, overlap_backward="auto")
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-3, offload=offload)
        print(opt.offload_plan)  # what is offloaded, and why
    """

    fraction: Fraction = 1.0
    pin_memory: bool = True
    threads: int | None = None
    staging_slots: int = 4
    overlap_backward: bool | Literal["auto"] = False
    huge_pages: bool = False
    switch_interval: float | None = 2e-4
    numa_node: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        problem = field_problem(self)
        if problem is not None:
            kind, message = problem
            raise kind(message)


@dataclass(frozen=True)
class OffloadPlan:
    """What one optimizer offloads (``optimizer.offload_plan``, read-only)."""

    fraction: float  # the fraction in effect
    requested: Fraction  # what the user asked for
    reason: str  # why this fraction (the measurements for "auto")
    threads: int  # CPU threads of the update
    host_params: int = 0  # trainable params whose update runs on the CPU
    device_params: int = 0  # trainable params whose update stays on the GPU
    host_numel: int = 0  # elements of this rank's shard on the host
    device_numel: int = 0  # elements of this rank's shard on the GPU
    measurements: dict[str, float] = field(default_factory=dict)
    #: bytes of optimizer state (masters, states, remainders, scales) this rank keeps in host
    #: memory instead of on the GPU: the GPU memory offload saves
    device_bytes_saved: int = 0
    #: ``fraction="auto"``: the step after which the fraction was re-planned from the measured
    #: backward (None before that, and for a fixed fraction)
    replanned_at_step: int | None = None
    #: the NUMA node of the host state and the update's CPUs (None: not placed; Note: NUMA
    #: placement in host_numa.py)
    numa_node: int | None = None

    def __str__(self) -> str:
        """One line: what is on the host and the GPU, the threads, the memory saved, why."""
        node = "" if self.numa_node is None else f" of NUMA node {self.numa_node}"
        return (
            f"CPU offload at fraction {self.fraction:.3f} (asked: {self.requested!r}): "
            f"{self.host_params} params ({self.host_numel} shard elements) updated on the host "
            f"by {self.threads} threads{node}, {self.device_params} params on the GPU, "
            f"{self.device_bytes_saved / 2**20:.1f} MiB of GPU memory saved; {self.reason}"
        )


def field_problem(offload: CPUOffload) -> tuple[type[Exception], str] | None:
    """The first field of ``offload`` of a wrong type or out of range, as (exception type,
    message naming the field), or None. The bound of ``threads`` that depends on the host (the
    CPUs this process may use) is ``resolve``'s, when the optimizer is built: there a rank on
    a smaller host fails every rank, not just itself."""
    f = offload.fraction
    if f != "auto":
        if isinstance(f, bool) or not isinstance(f, int | float):
            return TypeError, f"CPUOffload.fraction must be a float or 'auto', got {f!r}"
        if not 0.0 <= float(f) <= 1.0:
            return ValueError, f"CPUOffload.fraction must be in [0, 1], got {f}"
    t = offload.threads
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
        return ValueError, (
            "CPUOffload.threads must be None or an int >= 1 and at most the CPUs this process "
            f"may use, got {t!r}"
        )
    s = offload.staging_slots
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_STAGING_SLOTS:
        return ValueError, (
            f"CPUOffload.staging_slots must be an int >= 1 and at most {MAX_STAGING_SLOTS} "
            f"(more only hold host memory: a bucket chunk each), got {s!r}"
        )
    for flag in ("pin_memory", "huge_pages"):
        value = getattr(offload, flag)
        if not isinstance(value, bool):
            return TypeError, f"CPUOffload.{flag} must be a bool, got {value!r}"
    n = offload.numa_node
    if n is not None and n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        return ValueError, (
            f"CPUOffload.numa_node must be 'auto', a node number (an int >= 0) or None, got {n!r}"
        )
    si = offload.switch_interval
    if si is not None and (isinstance(si, bool) or not isinstance(si, int | float) or not si > 0):
        return ValueError, (
            f"CPUOffload.switch_interval must be a positive number of seconds or None, got {si!r}"
        )
    ob = offload.overlap_backward
    if not isinstance(ob, bool) and ob != "auto":
        return ValueError, f"CPUOffload.overlap_backward must be True, False or 'auto', got {ob!r}"
    return None


def resolve(owner: str, offload: object) -> CPUOffload | None:
    """The settings from the ``offload`` keyword; raises naming the problem."""
    if offload is None:
        return None
    if isinstance(offload, str):
        if offload != "cpu":
            raise ValueError(
                f"{owner}: offload must be None, 'cpu' or a shardopt.CPUOffload, got {offload!r}"
            )
        return CPUOffload()
    if not isinstance(offload, CPUOffload):
        raise TypeError(
            f"{owner}: offload must be None, 'cpu' or a shardopt.CPUOffload, got "
            f"{type(offload).__name__}"
        )
    problem = field_problem(offload)
    if problem is not None:  # (fields changed since construction: object.__setattr__)
        kind, message = problem
        raise kind(f"{owner}: {message}")
    t, cores = offload.threads, max_threads()
    if t is not None and t > cores:
        raise ValueError(
            f"{owner}: CPUOffload.threads must be None or an int >= 1 and at most the {cores} "
            f"CPUs this process may use (more only time-slice them), got {t!r}"
        )
    return offload


def local_ranks(env: dict[str, str] | None = None) -> int:
    """The ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``; 1 when unset or invalid)."""
    local = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "1")
    return int(local) if local.isdigit() and int(local) > 0 else 1


def thread_budget(threads: int | None, env: dict[str, str] | None = None) -> int:
    """CPU threads of one rank's update: ``threads``, or the usable cores split evenly among the
    local ranks (``LOCAL_WORLD_SIZE``), so ranks of one host never oversubscribe it, less one
    where a rank has four or more: the rank's main thread keeps a core to launch the forward and
    backward kernels the update overlaps (docs/offload.md: measured on one H200)."""
    if threads is not None:
        return threads
    ranks = local_ranks(env)
    cores = max_threads()
    share = max(1, cores // ranks)
    return share - 1 if share >= 4 else share


def split_params(numels: list[int], fraction: float) -> int:
    """How many of a key's params (given in registration order) stay on the GPU: the first ones,
    so that the last-registered ones hold ``fraction`` of the elements, rounded to the nearest
    whole param (see Note: which params stay on the GPU)."""
    total = sum(numels)
    if fraction >= 1.0 or total == 0:
        return 0
    if fraction <= 0.0:
        return len(numels)
    target = fraction * total
    offloaded, best, best_err = 0, len(numels), target
    for kept in range(len(numels) - 1, -1, -1):  # offload params kept..end
        offloaded += numels[kept]
        err = abs(offloaded - target)
        if err < best_err:
            best, best_err = kept, err
    return best


def floor_fraction(need_bytes: float, free_bytes: float) -> float:
    """The smallest fraction whose GPU share of ``need_bytes`` fits in ``free_bytes``."""
    if need_bytes <= free_bytes:
        return 0.0
    return min(max(1.0 - max(free_bytes, 0.0) / need_bytes, 0.0), 1.0)


def plan_fraction(
    *,
    numel: int,
    device_bytes_per_param: float,
    free_device_bytes: float,
    cpu_ms_per_param: float,
    copy_ms_per_param: float,
    gpu_ms_per_param: float,
    window_ms: float,
    headroom: float = 1.0,
) -> tuple[float, str]:
    """The ``fraction="auto"`` decision: (fraction, reason), from measurements.

    The optimizer time a step of fraction f exposes is about
    ``max((1-f)*n*gpu, f*n*(cpu + copy)*headroom - window)``: the GPU update of the part kept
    on the GPU runs while the worker updates the offloaded part on the CPU (with its copies),
    and that CPU work also hides in ``window`` (the backward it may start in and the next
    forward it may run into: see Note: what auto measures in offload_replan.py). Without
    offload it is ``n*gpu``. The shortest step is where both sides meet,
    ``f = (gpu + window/n) / (gpu + (cpu + copy)*headroom)``, capped at 1 and raised to the
    smallest fraction whose GPU state (``(1-f)*n*device_bytes_per_param``) fits in the free
    GPU memory; at equal time the larger fraction (more GPU memory saved) is taken.

    Args:
        numel: elements of this rank's shard.
        device_bytes_per_param: GPU bytes per element that offloading frees (master and state).
        free_device_bytes: GPU memory free for optimizer state.
        cpu_ms_per_param, copy_ms_per_param, gpu_ms_per_param: measured update and copy time
            per element (the copy: grad down and param up).
        window_ms: the time the CPU update can hide in (0 when nothing overlaps it).
        headroom: factor on the CPU side's time, for what the model leaves out (the worker
            thread sharing the host with the training loop).
    """
    if numel <= 0:
        return 1.0, "nothing to offload (empty shard)"
    if min(cpu_ms_per_param, copy_ms_per_param, gpu_ms_per_param, window_ms) < 0 or not (
        headroom >= 1.0
    ):
        raise ValueError(
            "plan_fraction: times must be >= 0 and headroom >= 1, got "
            f"cpu={cpu_ms_per_param}, copy={copy_ms_per_param}, gpu={gpu_ms_per_param}, "
            f"window={window_ms}, headroom={headroom}"
        )
    need = numel * device_bytes_per_param
    floor = floor_fraction(need, free_device_bytes)
    host_ms = numel * (cpu_ms_per_param + copy_ms_per_param) * headroom
    gpu_ms = numel * gpu_ms_per_param

    def step_ms(f: float) -> float:
        return max((1.0 - f) * gpu_ms, f * host_ms - window_ms)

    # step_ms is the max of a falling and a rising line: its minimum is where they meet
    meet = (gpu_ms + window_ms) / (gpu_ms + host_ms) if gpu_ms + host_ms > 0 else 1.0
    candidates = sorted({floor, 1.0, min(max(meet, floor), 1.0)})
    best = min(candidates, key=lambda f: (round(step_ms(f), 9), -f))
    reason = (
        f"state {need / 2**30:.2f} GiB vs {free_device_bytes / 2**30:.2f} GiB free on the GPU "
        f"(offload at least {floor:.3f}); CPU update + copies {host_ms:.1f} ms (headroom "
        f"{headroom:g}), GPU update {gpu_ms:.1f} ms, window {window_ms:.1f} ms: optimizer time "
        f"~{step_ms(best):.1f} ms at fraction {best:.3f} vs {gpu_ms:.1f} ms without offload"
    )
    return best, reason
