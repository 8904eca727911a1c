"""The ZeRO engine: construction and ``step()`` of every DistributedFused* optimizer.

``DistributedOptimizer`` is the base of every DistributedFused* class; a subclass names its state
and implements ``_update(...)`` with its algorithm's update rule (the same functions the
single-process class calls). The roles live in their own modules, composed here:

  - ``sharded_params``: the params checked across ranks, planned into keys, bound to buffers;
  - ``grad_sync``: the grad hooks and the bucketed reduce-scatter of one iteration;
  - ``amp``: the global grad norm, clipping and GradScaler handling;
  - ``param_sync``: the all-gather of the params after the update;
  - ``state_io``: the state-I/O interface and the torch.optim state dict;
  - ``offload_*``, ``host_state``: CPU offload (which keys live on the host, their update there,
    and auto's re-plan: see Note: the offloaded step, Note: the re-plan).

One step (default settings):
  1. backward: grads go into transient buckets, reduce-scattered as they fill (``grad_sync``);
  2. ``step()``: masters are re-seeded from params written since the last step (see Note: the
     params are the truth); the rest of the buckets launch and are waited for; one all-reduce of
     the grads' sum of squares when clipping, LAMB or a GradScaler needs it; averaging, inverse
     loss scale and clip coefficient fold into one device scalar; an inf/nan skips the step on
     every rank;
  3. the fused update of this rank's shard writes masters, state and (low-precision params) the
     param chunk in one pass; fp32 params are their own masters (updated in place);
  4. the all-gather of every bucket back into the params (``param_sync``); the grad shard is
     released.
With ``capturable=True`` nothing in an iteration syncs with the host and every collective is joined
before ``step()`` returns, so forward, backward and step can be captured in one CUDA graph.

Note: the params are the truth. A write into a param after the optimizer exists
(``model.load_state_dict``, an in-place init, a param re-bound with ``p.data = ...``) must not be
undone by a master: at the next step each master is kept only where it still rounds to its param,
else it takes the param's value. Writes are seen through each param's version counter (the
optimizer's own writes go into the buffer and do not move it); writes through ``p.data`` bypass
it and are not seen.

Note: torch.compile. Dynamo never traces the engine: ``step``, ``zero_grad``, ``clip_grad_norm``,
``grad_norm``, the grad hooks (grad_sync.py) and the param-sync forward hooks (param_sync.py) are
``torch.compiler.disable``d. They issue collectives and wait on their handles, read host state
(the unused-param flags, the params' data pointers) and keep Python bookkeeping that a graph
cannot hold; traced, they split into many graphs, and a grad hook traced during a ``backward()``
called inside a compiled function recompiles per param shape until Dynamo fails ("sources must
not be empty for symbol ..."; upstream, docs/integrations.md). Disabled, each is one eager call
(one graph break where compiled code calls it) that does exactly what it does in eager mode.
A ``torch.compile(module)`` wrapper runs no module hooks inside its graph, so the forward wait of
``overlap_param_sync`` waits for all of the wrapper's params when the wrapper itself is called.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardopt import kernels as _ops
from shardopt.optimizers.fused_optimizer import check_param_dtypes
from shardopt.zero import comm, sharded_params, state_storage, torch_clip, unsynced
from shardopt.zero.amp import AmpClip, StepScalars
from shardopt.zero.apex import compat as apex_compat
from shardopt.zero.apex import user_buffers
from shardopt.zero.grad_sync import GradSync
from shardopt.zero.layout import ShardLayout
from shardopt.zero.offload import auto as offload_auto
from shardopt.zero.offload import backward as offload_backward
from shardopt.zero.offload import host_state
from shardopt.zero.offload import pipeline as offload_pipeline
from shardopt.zero.offload import plan as offload_plan
from shardopt.zero.param_sync import ParamSync
from shardopt.zero.settings import (
    DEFAULT_BUCKET_CAP_MB,
    cap_chosen,
    check_plain_params,
    check_remainders,
    check_settings,
    resolve_layout,
)
from shardopt.zero.sharded_params import Key, ParamReboundError, ShardedParams, ShardingConfig
from shardopt.zero.state_io import StateIO
from shardopt.zero.update_calls import Call, UpdateCalls


class DistributedOptimizer(StateIO, apex_compat.ApexSurface, torch.optim.Optimizer):
    """Common engine of the ZeRO-sharded optimizers (not used directly).

    Each param group's keys are planned by ``shard_layout(self, group: dict) -> ShardLayout``
    (shardopt.zero.layout), which a subclass may override (per group: whole params for Muon's
    matrices, ``ElementLayout()`` for the rest); by default the constructor's ``shard_layout=``.
    """

    state_names: tuple[str, ...] = ()
    #: per state, whether it takes negative values (the 8-bit quantisation map it uses)
    state_signed: dict[str, bool] = {}
    #: whether the update rule runs on compact storage (remainders, 16-bit and 8-bit states)
    compact_storage: bool = False
    needs_grad_norm: bool = False  # LAMB's built-in clipping
    #: CPU offload: the update can run one bucket at a time (elementwise, no per-step extras)
    bucketwise_update: bool = False
    # torch.amp.GradScaler hands itself to step(grad_scaler=...): grads live in our buffers, so the
    # overflow check and unscaling happen inside the step (same decision on every rank).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        process_group: comm.ProcessGroup | None = None,
        redundant_process_group: comm.ProcessGroup | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        dtype: torch.dtype = torch.float32,
        grad_sync_dtype: torch.dtype | None = None,
        param_sync_dtype: torch.dtype | None = None,
        average_grad_sync: bool = True,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        capturable: bool = False,
        skip_unused_params: bool = True,
        state_format: str | None = None,
        offload: str | offload_plan.CPUOffload | None = None,
        shard_layout: ShardLayout | None = None,
        **apex_args: Any,
    ) -> None:
        name = type(self).__name__
        comm.require_initialized(name)
        whole_group = process_group
        apex = apex_compat.resolve(name, process_group, apex_args)
        process_group = apex["process_group"]
        apex_compat.check_apex_groups(name, whole_group, process_group, redundant_process_group)
        super().__init__(params, defaults)
        error, storage, ub, offload_settings, placement = None, None, None, None, None
        try:  # a setting wrong on one rank only must fail on every rank, not hang the others
            check_param_dtypes(self.param_groups, name)
            check_plain_params(name, self.param_groups)
            check_settings(
                name, grad_sync_dtype, param_sync_dtype, capturable, overlap_param_sync,
                bucket_cap_mb,
            )  # fmt: skip
            storage = state_storage.resolve(
                name,
                dtype=dtype,
                store_param_remainders=apex["store_param_remainders"],
                with_scaled_states=apex["with_scaled_states"],
                state_format=state_format,
                supported=self.compact_storage,
            )
            offload_settings = offload_plan.resolve(name, offload)
            self._shard_layout = resolve_layout(name, shard_layout)
            placement = offload_auto.numa_placement(name, offload_settings, self.param_groups)
            if offload_settings is not None and capturable:
                raise ValueError(
                    f"{name}: capturable=True cannot offload (the CPU update syncs with the "
                    "host); use offload=None"
                )
            if storage.remainders:
                check_remainders(name, self.param_groups, param_sync_dtype)
            if apex["nccl_ub"]:
                groups = [process_group]  # None: the default group
                if redundant_process_group is not None:
                    groups.append(redundant_process_group)
                device = _ops.common_device([p for g in self.param_groups for p in g["params"]])
                user_buffers.check(name, device, groups)
                ub = user_buffers.UserBuffers(name, device, groups)
        except (TypeError, ValueError, NotImplementedError) as e:
            error = e
        # (also: the offload settings the collectives depend on are the same on every rank)
        offload_auto.agree(name, error, offload_settings, process_group, redundant_process_group)
        self.redundant_process_group = redundant_process_group
        #: the NUMA placement of the offloaded host state and update (None: not placed)
        self._offload_placement = placement
        fraction = offload_auto.agreed_fraction(self, offload_settings, storage, process_group)
        #: the NCCL-registered pool of ``nccl_ub=True`` (zero/apex/user_buffers.py), or None
        self._user_buffers = ub
        self.process_group = process_group
        self.config = ShardingConfig(
            bucket_cap_mb=float(bucket_cap_mb),
            state_dtype=dtype,
            grad_sync_dtype=grad_sync_dtype,
            param_sync_dtype=param_sync_dtype,
            average_grad_sync=average_grad_sync,
            overlap_grad_sync=overlap_grad_sync,
            overlap_param_sync=overlap_param_sync,
            capturable=capturable,
            skip_unused_params=skip_unused_params and not capturable,
            storage=storage,
            nccl_ub=apex["nccl_ub"],
            offload_fraction=fraction,
            offload_huge_pages=offload_settings is not None and offload_settings.huge_pages,
        )
        self._pipeline_size = apex["pipeline_size"]
        self._bucket_cap_chosen = cap_chosen(bucket_cap_mb)
        self._offload_settings = offload_settings
        self._build(name)
        self._unsynced = unsynced.UnsyncedCheck(self)  # see Note: unsynced params
        apex_compat.check_device(name, apex["device"], self.device)
        # torch.nn.utils.clip_grad_norm_ on these params routes here (else: no .grad, a no-op)
        torch_clip.install()

    def _build(self, name: str) -> None:
        """Plans the params into keys under ``self.config`` and builds what works on them (at
        construction, and again when ``init_params`` asks for other per-param dtypes)."""
        ub = self._user_buffers
        process_group = self.process_group
        redundant_process_group = self.redundant_process_group
        offload_settings = self._offload_settings
        # offloaded host state is zero-filled in parallel (the update's thread budget), its pages
        # preferred on the placement's NUMA node before that first touch (host_numa.py)
        with offload_auto.first_touch(self, offload_settings):
            self.sharded = ShardedParams(
                self.param_groups,
                self.config,
                self.state_names,
                state_signed=self.state_signed,
                process_group=process_group,
                redundant_process_group=redundant_process_group,
                owner=name,
                layouts=[self.shard_layout(group) for group in self.param_groups],
                allocating=ub.allocating if ub is not None else contextlib.nullcontext,
            )
        if ub is not None:
            ub.register(self)
        sharded = self.sharded
        if self._bucket_cap_chosen:
            apex_compat.warn_underfilled(
                name, sharded.keys, self.config.bucket_cap_mb, sharded.world_size
            )
        self.rank, self.world_size = sharded.rank, sharded.world_size
        self.redundant_size = (
            comm.world_size(redundant_process_group) if redundant_process_group is not None else 1
        )
        self.device = sharded.device
        #: params in param-group order (frozen ones included); ``params``: the trainable ones
        self.all_params, self.params = sharded.all_params, sharded.params
        self.keys: list[Key] = sharded.keys
        for group in self.param_groups:
            group["step"] = torch.zeros((), dtype=torch.float32, device=self.device)
            # The state lives in shards; ``state`` names each trainable param's group step, so
            # code that takes an empty ``state`` for "never stepped" (torch.distributed.checkpoint
            # .state_dict fakes a step with zero ``.grad``s then) sees an initialised optimizer.
            for p in group["params"]:
                if p.requires_grad:
                    self.state[p] = {"step": group["step"]}
        self.grad_sync = GradSync(
            sharded,
            process_group=process_group,
            redundant_process_group=redundant_process_group,
            overlap=self.config.overlap_grad_sync,
            buckets_in_flight=self._pipeline_size,
        )
        ranks = self.world_size * self.redundant_size
        self.amp = AmpClip(
            sharded,
            self.grad_sync,
            process_group=process_group,
            grad_factor=1.0 / ranks if self.config.average_grad_sync else 1.0,
            capturable=self.config.capturable,
        )
        self.param_sync = ParamSync(
            sharded, process_group=process_group, overlap=self.config.overlap_param_sync
        )
        self.param_sync.finish_when_dropped(self)  # (dropped without close(): params updated)
        self.update_calls = UpdateCalls(sharded)
        # CPU offload: ``_offload_plan`` (offload_plan.OffloadPlan), the pipeline, auto's timer
        offload_auto.attach(self, offload_settings)
        sharded_params.claim(self.params, self)
        weakref.finalize(self, sharded_params.release, list(self.params), None)

    # settings read by scripts and benchmarks
    state_dtype = property(lambda self: self.config.state_dtype)
    storage = property(lambda self: self.config.storage)
    bucket_cap_mb = property(lambda self: self.config.bucket_cap_mb)
    capturable = property(lambda self: self.config.capturable)
    overlap_grad_sync = property(lambda self: self.config.overlap_grad_sync)
    overlap_param_sync = property(lambda self: self.config.overlap_param_sync)
    offload_plan = property(lambda self: self._offload_plan)  # None without offload

    def shard_layout(self, group: dict[str, Any]) -> ShardLayout:
        """The layout of ``group``'s keys (called by construction and every re-plan, once per
        group, before a subclass's ``__init__`` goes on after ``super().__init__``); it must
        give the same layout on every rank. Default: the constructor's ``shard_layout``."""
        return self._shard_layout

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only the constructor's groups: the flat layout is planned from them at construction."""
        if "keys" in vars(self):
            raise NotImplementedError(
                f"{type(self).__name__} does not support add_param_group after construction: its "
                "flat buffers and shards are planned from the param groups when it is built; "
                "pass every param group to the constructor (or build a new optimizer)"
            )
        super().add_param_group(param_group)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (the optimizer no longer syncs grads)."""
        return self.grad_sync.closed

    def close(self) -> None:
        """Removes the grad hooks and finishes in-flight param sync (the optimizer is unusable)."""
        offload_pipeline.close(self)  # wait_param_sync(), then the offload worker stops
        self.grad_sync.remove_hooks()
        sharded_params.release(self.params, self)

    # -- grad sync, norms, param sync --------------------------------------------------------------

    def finish_grad_sync(self) -> None:
        """Launches the buckets not yet reduce-scattered and waits for every reduce-scatter of
        this iteration (idempotent; ``step()`` calls it). Call it to end grad sync early, e.g. to
        time the update alone. Collective."""
        self.grad_sync.finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: grads of backward passes inside are accumulated, not synced.

        The first backward after the context (outside it) syncs the accumulated sum, as DDP's
        ``no_sync``.
        """
        with self.grad_sync.no_sync():
            yield

    @torch.compiler.disable  # see Note: torch.compile
    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full averaged gradient (loss-scaled if the loss was scaled).

        Collective: every rank must call it. Syncs outstanding grads first.
        """
        return self.amp.grad_norm()

    @torch.compiler.disable  # see Note: torch.compile
    def clip_grad_norm(self, max_norm: float, grad_scaler=None) -> torch.Tensor:
        """Clips the grads as ``torch.nn.utils.clip_grad_norm_`` would on the full averaged grads.

        The coefficient ``min(1, max_norm / (norm + 1e-6))`` is folded into the kernel's grad scale
        at ``step()`` (no extra pass); the norm's all-reduce carries the lockstep check (a host
        sync; see Note: lockstep). Call on every rank after the last backward, before ``step()``.

        Args:
            max_norm: the largest norm the averaged grads may have.
            grad_scaler: the GradScaler in use, if any; not needed after
                ``scaler.unscale_(optimizer)`` nor after a ``step()`` that received it.

        Returns:
            The total norm before clipping (a device scalar), unscaled when a GradScaler is known
            (the norm the step clips by, as ``torch.nn.utils.clip_grad_norm_`` returns it after
            ``scaler.unscale_(optimizer)``), else of the grads as they are.
        """
        return self.amp.clip(self, max_norm, grad_scaler)

    def wait_param_sync(self) -> None:
        """Waits for the param all-gathers of the last step (needed only with
        ``overlap_param_sync=True`` before reading params outside a module forward)."""
        self.param_sync.wait()

    # -- the step --------------------------------------------------------------------------------

    @torch.compiler.disable  # see Note: torch.compile
    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):  # noqa: D417
        """Syncs outstanding grads, updates this rank's shard and gathers the params back.

        Args:
            closure: optional callable re-evaluating the model; its loss is returned.
            grad_scaler: passed by ``torch.amp.GradScaler.step``; the overflow decision is the
                same on every rank and the step is skipped everywhere on inf/nan.
        """
        if self.grad_sync.closed:
            raise RuntimeError(
                f"{type(self).__name__}: step() after close(): the optimizer no longer syncs "
                "grads; build a new one"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.drop_staged()
        self.wait_param_sync()
        binding_error = None
        try:
            self.sharded.refresh_masters()
        except ParamReboundError as e:  # raised below on every rank, after the shared collectives
            binding_error = e
        self.grad_sync.finish()
        if self.config.skip_unused_params:
            failed = None if binding_error is None else binding_error.param
            unused, failed = self.grad_sync.unused_params(failed)
            if failed is not None:
                raise binding_error or RuntimeError(
                    f"{type(self).__name__}: param {failed} was replaced on another rank by a "
                    "tensor of another shape, dtype or device (that rank's error says how); no "
                    "rank steps"
                )
            self.update_calls.begin(unused)
        elif binding_error is not None:
            raise binding_error
        self._unsynced.check()  # the first steps, after the lockstep check: Note: unsynced params
        scalars = self.amp.step_scalars(self, grad_scaler, self.needs_grad_norm)
        offload_backward.check_early(self, scalars)  # misuse raises before any count moves
        for group in self.param_groups:
            if scalars.found_inf_t is None:
                group["step"].add_(1)
            else:
                group["step"].add_(1 - scalars.found_inf_t.reshape(()))
        offload_pipeline.update(self, scalars)  # _update(scalars), offloaded keys on the host
        self.param_sync.write_sync_space(scalars.found_inf_t)
        self.update_calls.end(scalars.found_inf_t)
        self.param_sync.start()
        self.grad_sync.lockstep.stepped()
        self._end_iteration()
        return loss

    def _end_iteration(self) -> None:
        offload_auto.at_boundary(self)  # fraction="auto": times the first steps, re-plans once
        self.grad_sync.reset()
        self.amp.reset()

    def _update(self, scalars: StepScalars) -> None:
        raise NotImplementedError

    @torch.compiler.disable  # see Note: torch.compile
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops grads accumulated but not yet synced (``no_sync`` micro-batches) and any
        ``param.grad``, after finishing this iteration's collectives (none is dropped in flight).
        After ``step()`` there is nothing to clear: grad buffers are transient."""
        for p in self.all_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for handle in self.grad_sync.iteration.handles:
            handle.wait()
        self.grad_sync.drop()  # see Note: lockstep (lockstep.py)
        self._end_iteration()

    # -- what the update rules read --------------------------------------------------------------

    @staticmethod
    def _to_update(buf: Any, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` where ``buf``'s update runs (the host for an offloaded key)."""
        if t is None or buf is None or not buf.offloaded:
            return t
        return host_state.to_host(t)

    def _grads(self, buf: Any) -> torch.Tensor:
        """The grad shard the update of ``buf`` reads (its host copy when offloaded)."""
        return buf.host_grad if buf.offloaded else buf.grad_shard

    def _each_call(self) -> Iterator[tuple[dict, Any, Call]]:
        """(group, buffers, call) of every elementwise kernel call of this step, key by key."""
        for key in self.keys:
            for call in self._calls(key):
                yield self.param_groups[key.group_index], key.buffers, call

    def _calls(self, key: Key, per_tensor: bool = False) -> list[Call]:
        """This step's kernel calls over ``key`` (see Note: skipped params in update_calls.py):
        per bucket chunk, or per fragment for rules with per-tensor norms (inside
        ``update_calls.within``, only those of its window)."""
        return self.update_calls.calls(key, per_tensor)

    def _member_index(self, key: Key) -> torch.Tensor:
        """Engine param indices of every param of ``key`` (device vector)."""
        return self.sharded.member_indices[key.index]

    def enter_collective(self, call: str) -> None:
        """Waits until every rank of the optimizer's groups enters the collective ``call`` (a
        name such as ``"state_dict()"``), so a collective made on some ranks only raises
        ``CollectiveCallError`` on every rank instead of hanging (see Note: arrival check,
        comm.py). The optimizer's state-I/O calls make it themselves; a saver or integration
        that runs a collective of its own over the optimizer's state calls it first."""
        name = f"{type(self).__name__}.{call}"
        comm.arrive(name, self.process_group)
        if self.redundant_process_group is not None:
            comm.arrive(name, self.redundant_process_group)
        # CPU offload: state I/O between backward and step (see Note: state I/O between
        # backward and step in offload_backward.py)
        offload_backward.before_state_io(self, call)

    # -- introspection ---------------------------------------------------------------------------

    def memory_bytes(self, where: str = "device") -> dict[str, int]:
        """Bytes of every persistent buffer this optimizer holds, summed over keys.

        Args:
            where: ``"device"`` (the default): on its device; ``"host"``: in host memory (CPU
                offload: the masters, states, remainders and scales of offloaded keys, under the
                same names, and ``staging``, the exact-size staging slots; empty without
                offload).
        """
        if where not in ("device", "host"):
            raise ValueError(f"memory_bytes: where must be 'device' or 'host', got {where!r}")
        out: dict[str, int] = {}
        for key in self.keys:
            for name, n in key.buffers.bytes(where).items():
                out[name] = out.get(name, 0) + n
        if where == "host" and self._offload_pipeline is not None:
            out["staging"] = self._offload_pipeline.staging_bytes()
        return out
