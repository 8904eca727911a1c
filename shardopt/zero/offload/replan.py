"""CPU offload, ``fraction="auto"`` after the first steps: the decision from measured times, and
the one re-plan that applies it at a step boundary.

Note: what auto measures
    At construction nothing has run: auto offloads only the share of the state that does not
    fit in the free GPU memory (none on a CPU job). The grad sync's hooks then time the first
    ``MEASURED_STEPS`` steps (offload_measure.BackwardTimer; the first step warms up and is not
    kept): the backward, from its first grad hook to the last grad hook or reduce-scatter
    launch in it, and the forward before it, from the end of the previous ``step()``. At the
    end of step ``MEASURED_STEPS`` rank 0 measures the CPU update, copy and GPU update speeds
    (offload_measure.measure) and the GPU memory the state may take (``device_budget``) and
    picks the fraction (offload_plan.plan_fraction). The window the offloaded part's CPU update
    and copies can hide in is what the pipeline overlaps them with (offload_pipeline.py): the
    backward when its updates may start during backward (``CPUOffload(overlap_backward=True)``,
    or ``"auto"`` after steps without clipping, GradScaler or a second synchronised backward),
    plus the next forward with ``overlap_param_sync=True`` (a forward waits only for the
    buckets it needs); the GPU update of the part kept on the GPU runs beside it in any case.
    On a CPU job the device is the host, so auto stays at 0 there.

Note: the re-plan
    Rank 0's decision is broadcast (every rank gets the same key split; with HSDP, that of the
    first replica). When the fraction changes, ``step()`` ends by moving the state: the full
    state is gathered through the torch.optim state dict (the same path as ``state_dict()``:
    masters, states and each param's steps, on the host, one bucket on the device at a time),
    the keys are planned again with the new fraction (the same planning as a construction with
    that fraction, so the layout, buckets and results are those of an optimizer built with it
    and loaded with that state, bit for bit), and the state is loaded back into them
    (``load_state_dict``'s path: the params are the truth, the masters kept where they round to
    them). The old keys' masters and states are dropped before the new ones are allocated, so
    the device never holds both. It costs one state-dict round trip (host memory of the full
    state, briefly) once per run. Checkpoints taken before or after it are ordinary ones and
    load into any optimizer. When the host memory of a rank cannot hold the new fraction's
    state (``host_memory.HostMemoryError``, raised on every rank), the keys are planned again
    with the fraction in effect and the run goes on with it (the reason says so; the failing
    rank logs its error). The decision and its reason are logged once (``shardopt`` logger,
    INFO) and kept in ``optimizer.offload_plan`` (``replanned_at_step``,
    ``device_bytes_saved``). ``SHARDOPT_OFFLOAD_AUTO_MEASURED`` (JSON of ``cpu_ms``,
    ``copy_ms``, ``gpu_ms`` per element, ``free_bytes``, ``forward_ms``, ``backward_ms``)
    replaces what was measured (tests use it to make a CPU job re-plan).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import torch

from shardopt.zero import comm, sharded_params
from shardopt.zero.offload import host_memory, host_state
from shardopt.zero.offload import measure as offload_measure
from shardopt.zero.offload.plan import plan_fraction

logger = logging.getLogger("shardopt")

#: the steps timed before the re-plan (the first is a warm-up, not kept)
MEASURED_STEPS = 3
#: factor on the CPU side's measured time: the worker shares the host with the training loop and
#: its grad and param copies, and its update runs bucket by bucket; on one H200's host (16
#: cores) the offloaded 1.32B GPT's bucket updates took 1.4-1.55x the same update in one call
#: alone (docs/benchmarks.md, launch_scripts/probe/trace_offload.py and probe_offload_update.py)
HEADROOM = 1.5
#: JSON of measurements that replace those taken (see Note: the re-plan)
MEASURED_ENV = "SHARDOPT_OFFLOAD_AUTO_MEASURED"
_KNOWN = {"cpu_ms", "copy_ms", "gpu_ms", "free_bytes", "forward_ms", "backward_ms"}


def install(optimizer) -> None:
    """Starts timing the first steps of an optimizer with ``fraction="auto"`` (once: not again
    after its re-plan)."""
    if getattr(optimizer, "_offload_timer", None) is None:
        optimizer._offload_timer = offload_measure.BackwardTimer(optimizer.device)
    timer = optimizer._offload_timer
    if timer is not False:
        timer.install(optimizer.grad_sync)


def injected() -> dict[str, float]:
    """The measurements of ``SHARDOPT_OFFLOAD_AUTO_MEASURED`` ({} when unset); raises naming a
    bad value."""
    text = os.environ.get(MEASURED_ENV)
    if not text:
        return {}
    try:
        values = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{MEASURED_ENV} must be a JSON object, got {text!r}: {e}") from None
    if not isinstance(values, dict) or set(values) - _KNOWN:
        raise ValueError(
            f"{MEASURED_ENV} must be a JSON object with keys among {sorted(_KNOWN)}, got {text!r}"
        )
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(f"{MEASURED_ENV}: {name} must be a number >= 0, got {v!r}")
    return {k: float(v) for k, v in values.items()}


def at_boundary(optimizer) -> None:
    """The end of an iteration (``step()`` or ``zero_grad()``): keeps the timings of a measured
    step and re-plans after step ``MEASURED_STEPS`` (see Note: the re-plan). Collective at that
    step (every rank reaches it in the same ``step()``)."""
    timer = getattr(optimizer, "_offload_timer", None)
    if not timer:  # no auto, or already re-planned
        return
    steps = optimizer.grad_sync.lockstep.steps
    if steps == getattr(timer, "seen_steps", 0):
        timer.dropped()  # zero_grad(): no step ended here
        return
    timer.seen_steps = steps
    timer.step_ended(measured=steps > 1)
    if steps < MEASURED_STEPS:
        return
    timer.remove()
    optimizer._offload_timer = False  # measured once: the re-plan below is the only one
    fraction, reason, found = _decide(optimizer, timer)
    _replan(optimizer, fraction, reason, found, steps)


def _window(optimizer, forward_ms: float, backward_ms: float) -> tuple[float, str]:
    """The time the CPU update can hide in, and what it is made of."""
    settings = optimizer._offload_settings
    amp, it = optimizer.amp, optimizer.grad_sync.iteration
    clean = amp.max_norm is None and amp._scaler is None and not it.rounds
    early = settings.overlap_backward is True or (settings.overlap_backward == "auto" and clean)
    early = early and optimizer.redundant_process_group is None
    window, parts = 0.0, []
    if early:
        window += backward_ms
        parts.append("backward")
    if optimizer.overlap_param_sync:
        window += forward_ms
        parts.append("next forward")
    return window, " + ".join(parts) if parts else "nothing overlaps the CPU update"


def _decide(optimizer, timer) -> tuple[float, str, dict[str, float]]:
    """Rank 0's decision, taken by every rank (a failure to measure keeps the fraction in
    effect on every rank, with the reason)."""
    group = optimizer.process_group
    decision = None
    if comm.rank(group) == 0:
        try:
            decision = _measure_and_plan(optimizer, timer)
        except Exception as e:  # noqa: BLE001 (any failure here must not leave the others waiting)
            current = optimizer.config.offload_fraction
            decision = (current, f"auto: kept fraction {current:.3f}, could not measure: {e}", {})
    decision = comm.all_gather_object(decision, group)[0]
    redundant = optimizer.redundant_process_group
    if redundant is not None:  # HSDP: every replica takes the first one's split
        decision = comm.all_gather_object(decision, redundant)[0]
    return decision


def _measure_and_plan(optimizer, timer) -> tuple[float, str, dict[str, float]]:
    forced = injected()
    forward_ms, backward_ms = timer.windows()
    found = {"forward_ms": forward_ms, "backward_ms": backward_ms}
    params = optimizer.params
    if optimizer.device.type != "cuda" and not forced:
        reason = (
            f"auto: a CPU job (the device is the host; backward {backward_ms:.1f} ms, forward "
            f"{forward_ms:.1f} ms): nothing to gain from offloading"
        )
        return 0.0, reason, found
    grad = 4 if any(p.dtype != torch.float32 for p in params) else params[0].itemsize
    param = max(p.element_size() for p in params)
    with host_state.threads(optimizer._offload_threads):
        if not _KNOWN - {"free_bytes", "forward_ms", "backward_ms"} <= set(forced):
            found.update(offload_measure.measure(optimizer.device, grad, param))
    found["free_bytes"] = offload_measure.device_budget(optimizer)
    found.update(forced)
    window, what = _window(optimizer, found["forward_ms"], found["backward_ms"])
    numel = -(-sum(p.numel() for p in params) // optimizer.world_size)
    fraction, reason = plan_fraction(
        numel=numel,
        device_bytes_per_param=offload_measure.state_bytes_per_param(
            optimizer, params, optimizer.config.storage
        ),
        free_device_bytes=found["free_bytes"],
        cpu_ms_per_param=found["cpu_ms"],
        copy_ms_per_param=found["copy_ms"],
        gpu_ms_per_param=found["gpu_ms"],
        window_ms=window,
        headroom=HEADROOM,
    )
    measured = "given" if forced else "measured"
    reason = (
        f"auto: {reason} (window: {what}; backward {found['backward_ms']:.1f} ms, forward "
        f"{found['forward_ms']:.1f} ms, {measured} over steps 2-{MEASURED_STEPS})"
    )
    return fraction, reason, {k: v for k, v in found.items() if math.isfinite(v)}


def _replan(optimizer, fraction: float, reason: str, found: dict, steps: int) -> None:
    """Applies the decision (see Note: the re-plan) and logs it once."""
    name = type(optimizer).__name__
    if optimizer._user_buffers is not None and fraction != optimizer.config.offload_fraction:
        current = optimizer.config.offload_fraction
        reason = (
            f"auto: kept fraction {current:.3f} (nccl_ub=True: the registered pool was sized for "
            f"the layout planned at construction; the measured choice was {fraction:.3f})"
        )
        fraction = current
    optimizer._offload_reason, optimizer._offload_measurements = reason, found
    if fraction != optimizer.config.offload_fraction:
        current = optimizer.config.offload_fraction
        failed = _rebuild(optimizer, name, fraction)
        if failed is not None:  # the same reason on every rank; the failing one logs its error
            reason = (
                f"auto: kept fraction {current:.3f}: the host memory of a rank could not hold "
                f"the offloaded state of fraction {fraction:.3f} (the measured choice: "
                f"{reason})"
            )
            fraction = current
            logger.warning("%s: %s", name, failed)
    plan = optimizer.offload_plan
    # the plan of the keys as they are now, with the decision (a rebuild recorded it already)
    optimizer._offload_plan = dataclasses.replace(
        plan, fraction=float(fraction), reason=reason, measurements=dict(found),
        replanned_at_step=steps,
    )  # fmt: skip
    plan = optimizer._offload_plan
    if optimizer.rank == 0:
        logger.info(
            "%s: CPU offload fraction %.3f after step %d: %d params (%d shard elements) on the "
            "CPU on %d threads, %d params on the GPU, %.1f MiB of GPU memory saved; %s",
            name, plan.fraction, steps, plan.host_params, plan.host_numel, plan.threads,
            plan.device_params, plan.device_bytes_saved / 2**20, plan.reason,
        )  # fmt: skip


@torch.no_grad()
def _rebuild(optimizer, name: str, fraction: float) -> host_memory.HostMemoryError | None:
    """The keys planned again with ``fraction``, the state carried over exactly. When the host
    cannot hold that fraction's state (on any rank: the error is raised on every rank), the
    keys are planned again with the fraction in effect instead, and the error is returned."""
    saved = optimizer._gather_state_dict()  # waits for the last step's worker and all-gathers
    # what was derived from the old keys goes with them: the engine's roles are built anew
    # below (their calls, masks and indices), and state I/O's uncommitted copies are dropped
    optimizer.drop_staged()
    lockstep, scaler = optimizer.grad_sync.lockstep, optimizer.amp._scaler
    amp, it = optimizer.amp, optimizer.grad_sync.iteration
    clean = amp.max_norm is None and scaler is None and not it.rounds  # the step just taken
    before = optimizer.config.offload_fraction
    # the old masters and states go before the new ones are allocated (the device never holds
    # both); the params keep their values in the old param buffers until the new ones bind them
    _drop_keys(optimizer)
    optimizer.config = dataclasses.replace(optimizer.config, offload_fraction=float(fraction))
    failed = None
    try:
        optimizer._build(name)
    except host_memory.HostMemoryError as e:  # on every rank (offload_auto.first_touch)
        failed = e
        _drop_keys(optimizer)  # what the build made before the allocation failed
        optimizer.config = dataclasses.replace(optimizer.config, offload_fraction=before)
        optimizer._build(name)
    # what outlives an iteration: the lockstep count, the GradScaler seen, the last step's kind
    optimizer.grad_sync.lockstep, optimizer.amp._scaler = lockstep, scaler
    if optimizer._offload_pipeline is not None:
        optimizer._offload_pipeline.early.clean_before = clean
    optimizer._scatter_state_dict(saved)
    return failed


def _drop_keys(optimizer) -> None:
    """Releases the keys and the roles built on them (hooks, the offload worker and its staging
    slots, the params' owner), also those of a build that stopped part way."""
    pipeline = optimizer._offload_pipeline
    if optimizer.param_sync is not None:
        optimizer.param_sync.close()
    if pipeline is not None:
        pipeline.worker.stop()
        for ring in pipeline._rings():
            ring.release()
    if optimizer.grad_sync is not None:
        optimizer.grad_sync.remove_hooks()
    sharded_params.release(optimizer.params, optimizer)
    for attr in ("sharded", "keys", "grad_sync", "amp", "param_sync", "update_calls"):
        setattr(optimizer, attr, None)
    optimizer._offload_pipeline = None
