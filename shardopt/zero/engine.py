"""The ZeRO engine: grad hooks, bucketed grad sync, the sharded step, param sync, state dicts.

``DistributedOptimizer`` is the base of every DistributedFused* class; a subclass names its state
and implements ``_update(...)`` with its algorithm's update rule (the same functions the
single-process class calls). See Note: buckets and shards (layout.py) and docs/design.md.

One step (default settings):
  1. backward: each param's post-accumulate-grad hook copies its grad into its bucket's transient
     grad buffer (allocated when the bucket's first grad arrives; added to under ``no_sync``) and
     frees ``param.grad``; a bucket whose params have all arrived is reduce-scattered
     asynchronously into this rank's grad shard, strictly in bucket order (so every rank issues
     collectives in one order even when some params get no grad on some ranks), and its buffer is
     released once the reduce-scatter two buckets later is launched (bounded extra memory, no
     full-size grad buffer, nothing to zero);
  2. ``step()``: launch what is left, wait; one all-reduce for the global grad norm when clipping,
     LAMB or a GradScaler needs it; inverse loss scale, averaging and clip coefficient fold into one
     device scalar the kernels read; an inf/nan skips the step on every rank (same all-reduced sum);
  3. the fused update of this rank's shard writes masters, state and (low-precision params) the
     param chunk in one pass; fp32 params are their own masters (updated in place);
  4. all-gather of every bucket back into the params, in forward order; with
     ``overlap_param_sync`` each module's forward waits only for its own params' buckets;
     the grad shard is released.
With ``capturable=True`` nothing in an iteration syncs with the host and every collective is joined
before ``step()`` returns, so forward, backward and step can be captured in one CUDA graph.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import _ops
from shardopt.optimizers.fused_optimizer import (
    LOW_PRECISION,
    check_grad,
    check_loaded_groups,
    check_param_dtypes,
    device_lr,
)
from shardopt.zero import comm
from shardopt.zero.flat_buffer import KeyBuffers
from shardopt.zero.layout import KeyLayout, Range, plan_key

# GradScaler still hands itself to optimizers whose step() takes ``grad_scaler`` (its documented
# contract for optimizers that manage their own grads); silence only that deprecation notice.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)

ALIGN_BYTES = 128
# Reduce-scatters in flight during backward before the oldest is waited on (on the compute
# stream, no host sync on NCCL) and its transient grad bucket released.
MAX_GRAD_BUCKETS_IN_FLIGHT = 2


def _set_hyper(group: dict, name: str, value: Any) -> None:
    """Sets a loaded hyperparameter; a tensor one (lr of a captured step) is updated in place."""
    current = group.get(name)
    if torch.is_tensor(current):
        current.fill_(float(value))
    elif isinstance(current, tuple):
        group[name] = tuple(value)
    else:
        group[name] = value


@dataclass
class _Key:
    """One (param group, param dtype) set of params, its plan and its buffers."""

    index: int
    group_index: int
    param_dtype: torch.dtype
    layout: KeyLayout
    buffers: KeyBuffers


@dataclass
class StepScalars:
    """Device scalars of one step, shared by every key's update."""

    grad_scale_t: torch.Tensor  # averaging x inverse loss scale x clip coefficient
    found_inf_t: torch.Tensor | None
    sumsq: torch.Tensor | None  # all-reduced sum of squares of the summed grads (if computed)


class DistributedOptimizer(torch.optim.Optimizer):
    """Common engine of the ZeRO-sharded optimizers (not used directly)."""

    state_names: tuple[str, ...] = ()
    needs_grad_norm: bool = False  # LAMB's built-in clipping
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
        bucket_cap_mb: float = 100.0,
        dtype: torch.dtype = torch.float32,
        grad_sync_dtype: torch.dtype | None = None,
        param_sync_dtype: torch.dtype | None = None,
        average_grad_sync: bool = True,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        capturable: bool = False,
    ) -> None:
        name = type(self).__name__
        comm.require_initialized(name)
        super().__init__(params, defaults)
        check_param_dtypes(self.param_groups, name)
        if dtype != torch.float32:
            raise TypeError(
                f"{name}: dtype (master/state dtype) must be torch.float32, got {dtype}"
            )
        for arg, value in (
            ("grad_sync_dtype", grad_sync_dtype),
            ("param_sync_dtype", param_sync_dtype),
        ):
            if value not in (None, torch.float32, torch.float16, torch.bfloat16, torch.float64):
                raise TypeError(f"{name}: {arg} must be a floating dtype, got {value}")
        if capturable and overlap_param_sync:
            raise ValueError(
                f"{name}: capturable=True needs the param all-gathers to finish inside step() "
                "(a CUDA graph must join all its work); use overlap_param_sync=False"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"{name}: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.process_group = process_group
        self.redundant_process_group = redundant_process_group
        self.rank = comm.rank(process_group)
        self.world_size = comm.world_size(process_group)
        self.redundant_size = (
            comm.world_size(redundant_process_group) if redundant_process_group is not None else 1
        )
        self.state_dtype = dtype
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.average_grad_sync = average_grad_sync
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = overlap_param_sync
        self.capturable = capturable
        self.bucket_cap_mb = bucket_cap_mb

        # Params in param-group order; frozen ones get no buckets and no state.
        self.all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        for p in self.all_params:
            if p.dtype == torch.float64:
                raise TypeError(
                    f"{name} supports float32, float16 and bfloat16 params; use FusedAdam etc. "
                    "for float64"
                )
        self.params: list[torch.Tensor] = [p for p in self.all_params if p.requires_grad]
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        position = {id(p): i for i, p in enumerate(self.all_params)}
        #: engine param index -> index among all params (torch.optim state-dict ids)
        self.all_index = [position[id(p)] for p in self.params]
        self.device = _ops.common_device(self.all_params, "params")
        self._check_same_params_everywhere()
        self._broadcast_params()
        self.keys: list[_Key] = self._build_keys(bucket_cap_mb)
        self._param_key: dict[int, _Key] = {i: key for key in self.keys for i in key.layout.params}
        #: param -> (bucket index, bucket_range, param_range) of each bucket it has elements in
        self._pieces: dict[int, list[tuple[int, Range, Range]]] = {
            i: key.layout.param_pieces(i) for key in self.keys for i in key.layout.params
        }
        self._param_buckets: dict[int, list[int]] = {
            i: [b for b, _, _ in pieces] for i, pieces in self._pieces.items()
        }
        self._bind_params_to_buffers()
        # Built once so the step does no host-to-device copies (LAMB's and NovoGrad's per-param
        # reductions index with them).
        self._fragment_indices = [
            torch.tensor(
                [f.param for f in k.buffers.fragments], dtype=torch.long, device=self.device
            )
            for k in self.keys
        ]
        self._member_indices = [
            torch.tensor(list(k.layout.params), dtype=torch.long, device=self.device)
            for k in self.keys
        ]
        self._module_bucket_cache: dict[int, list[tuple[int, int]]] = {}
        for group in self.param_groups:
            group["step"] = torch.zeros((), dtype=torch.float32, device=self.device)
        self._sync_enabled = True
        self._max_norm: float | None = None
        self._reset_iteration()
        self._param_sync_pending: dict[tuple[int, int], comm.Handle] = {}
        self._forward_hook = None
        # The hooks hold the optimizer weakly: params outlive it, and a strong reference would keep
        # every buffer alive after the optimizer is dropped.
        ref = weakref.WeakMethod(self._grad_hook)

        def hook(p: torch.Tensor) -> None:
            method = ref()
            if method is not None:
                method(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only the constructor's groups: the flat layout is planned from them at construction."""
        if "keys" in vars(self):
            raise NotImplementedError(
                f"{type(self).__name__} does not support add_param_group after construction: its "
                "flat buffers and shards are planned from the param groups when it is built; "
                "pass every param group to the constructor (or build a new optimizer)"
            )
        super().add_param_group(param_group)

    def close(self) -> None:
        """Removes the grad hooks and finishes in-flight param sync (the optimizer is unusable)."""
        self.wait_param_sync()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()

    # -- construction ----------------------------------------------------------------------------

    def _check_same_params_everywhere(self) -> None:
        """Every rank must register the same params (order, shape, dtype, requires_grad)."""
        desc = [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in self.all_params]
        descs = comm.all_gather_object(desc, self.process_group)
        for r, other in enumerate(descs):
            if other == desc:
                continue
            diffs = [
                f"param {i}: rank {self.rank} has {a}, rank {r} has {b}"
                for i, (a, b) in enumerate(zip(desc, other))
                if a != b
            ]
            if len(desc) != len(other):
                diffs.insert(
                    0, f"rank {self.rank} has {len(desc)} params, rank {r} has {len(other)}"
                )
            raise RuntimeError(
                f"{type(self).__name__}: params differ between ranks (same model, same order "
                "required on every rank): " + "; ".join(diffs[:5])
            )

    def _broadcast_params(self) -> None:
        """Every rank starts from rank 0's params, as DDP does."""
        with torch.no_grad():
            comm.broadcast([p.data for p in self.all_params], 0, self.process_group)
            if self.redundant_process_group is not None:
                comm.broadcast([p.data for p in self.all_params], 0, self.redundant_process_group)

    def _build_keys(self, bucket_cap_mb: float) -> list[_Key]:
        by_key: dict[tuple[int, torch.dtype], list[int]] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    by_key.setdefault((gi, p.dtype), []).append(self.param_index[id(p)])
        keys = []
        for (gi, dtype), indices in by_key.items():
            grad_dtype = self._grad_sync_dtype_for(dtype)
            sync_dtype = self.param_sync_dtype or dtype
            smallest = min(t.itemsize for t in (dtype, grad_dtype, sync_dtype))
            bucket_numel = int(bucket_cap_mb * 2**20) // grad_dtype.itemsize
            layout = plan_key(
                [(i, self.params[i].numel()) for i in indices],
                world_size=self.world_size,
                bucket_numel=max(bucket_numel, 1),
                align_numel=ALIGN_BYTES // smallest,
            )
            buffers = KeyBuffers(
                layout,
                self.rank,
                device=self.device,
                param_dtype=dtype,
                grad_sync_dtype=grad_dtype,
                param_sync_dtype=sync_dtype,
                state_dtype=self.state_dtype,
                state_names=self.state_names,
            )
            keys.append(_Key(len(keys), gi, dtype, layout, buffers))
        return keys

    def _grad_sync_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        if self.grad_sync_dtype is not None:
            return self.grad_sync_dtype
        # Low-precision params accumulate and sync grads in fp32 unless told otherwise.
        return torch.float32 if param_dtype in LOW_PRECISION else param_dtype

    @torch.no_grad()
    def _bind_params_to_buffers(self) -> None:
        """Params become views of their key's param buffer; masters start from the params."""
        for key in self.keys:
            buf = key.buffers
            for i in key.layout.params:
                p = self.params[i]
                view = buf.param_view(i, p.shape)
                view.copy_(p.data)
                p.data = view
            if buf.master_is_param:
                continue
            for f, master in zip(buf.fragments, buf.per_fragment(buf.master)):
                master.copy_(buf.fragment_param_view(self.params[f.param].data, f))

    # -- gradient sync ---------------------------------------------------------------------------

    def _reset_iteration(self) -> None:
        self._pending = {
            (k.index, b.index): len(b.params) for k in self.keys for b in k.layout.buckets
        }
        self._order = [(k.index, b.index) for k in self.keys for b in k.layout.buckets]
        self._next_launch = 0
        self._grad_handles: list[comm.Handle] = []
        self._next_wait = 0  # first handle in _grad_handles not yet waited on
        self._grad_synced = False
        self._arrived: set[int] = set()
        self._written: set[int] = set()  # params whose grads are in a live grad bucket
        # transient grad buffers go back to the allocator; anything that read them (the update
        # kernels) was queued on this stream, so reuse is ordered after it
        for key in self.keys:
            key.buffers.grad_buckets.clear()
            key.buffers.release_grad_shard()
        self._sumsq: torch.Tensor | None = None

    def _grad_hook(self, p: torch.Tensor) -> None:
        i = self.param_index[id(p)]
        key = self._param_key[i]
        if self._grad_synced or (self._sync_enabled and i in self._arrived):
            raise RuntimeError(
                f"{type(self).__name__}: param {i} got a second gradient after its bucket was "
                "synchronised in this iteration; wrap all but the last micro-batch's backward in "
                "optimizer.no_sync(), and call step() before the next synchronised backward"
            )
        check_grad(p, type(self).__name__)
        buf = key.buffers
        grad = p.grad.reshape(-1)
        first = i not in self._written
        with torch.no_grad():
            for b, in_bucket, in_param in self._pieces[i]:
                dst = buf.grad_bucket(b).narrow(0, in_bucket.start, in_bucket.numel)
                src = grad.narrow(0, in_param.start, in_param.numel)
                if first:
                    dst.copy_(src)
                else:
                    dst.add_(src)
        self._written.add(i)
        p.grad = None
        if not self._sync_enabled:
            return
        self._arrived.add(i)
        for b in self._param_buckets[i]:
            self._pending[(key.index, b)] -= 1
        if self.overlap_grad_sync:
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        """Launches reduce-scatters strictly in bucket order, up to the first incomplete one."""
        while self._next_launch < len(self._order):
            ki, bi = self._order[self._next_launch]
            if not force and self._pending[(ki, bi)] > 0:
                return
            self._grad_handles.append(self._reduce_scatter_bucket(self.keys[ki], bi))
            self._next_launch += 1
            if not force:
                # bound the transient grad memory; the step waits for the rest
                while self._next_wait < len(self._grad_handles) - MAX_GRAD_BUCKETS_IN_FLIGHT:
                    self._grad_handles[self._next_wait].wait()
                    self._next_wait += 1

    def _reduce_scatter_bucket(self, key: _Key, bi: int) -> comm.Handle:
        """Completes a bucket's grads (zeros where no grad arrived) and reduce-scatters it into
        this rank's grad shard; the bucket's buffer lives until the handle is waited on."""
        buf = key.buffers
        bucket = key.layout.buckets[bi]
        fresh = bi not in buf.grad_buckets
        grads = buf.grad_bucket(bi)
        if fresh:  # no grad of this bucket arrived on this rank
            grads.zero_()
        else:
            holes = [grads.narrow(0, r.start, r.numel) for r in bucket.gaps]
            for i in bucket.params:
                if i not in self._written:
                    r = next(r for b, r, _ in self._pieces[i] if b == bi)
                    holes.append(grads.narrow(0, r.start, r.numel))
            if holes:
                torch._foreach_zero_(holes)
        buf.release_grad_bucket(bi)
        return comm.reduce_scatter(
            buf.shard_of_bucket(buf.grad_shard, bucket), grads, self.process_group
        )

    def finish_grad_sync(self) -> None:
        """Launches the buckets not yet reduce-scattered and waits for every reduce-scatter of
        this iteration (idempotent; ``step()`` calls it). Call it to end grad sync early, e.g. to
        time the update alone. Collective."""
        if self._grad_synced:
            return
        for p in self.all_params:
            if p.grad is not None:
                raise RuntimeError(self._stray_grad_message(p))
        self._launch_ready(force=True)
        for h in self._grad_handles:
            h.wait()
        self._grad_handles = []
        self._next_wait = 0
        if self.redundant_process_group is not None:
            for key in self.keys:
                comm.all_reduce(key.buffers.grad_shard, self.redundant_process_group)
        self._grad_synced = True

    def _stray_grad_message(self, p: torch.Tensor) -> str:
        name = type(self).__name__
        if id(p) not in self.param_index:
            return (
                f"{name}: a param that was frozen (requires_grad=False) when the optimizer was "
                "built now has a gradient; changing requires_grad after construction is not "
                "supported: build the optimizer again"
            )
        return (
            f"{name}: a param has .grad set at step time, so something other than this optimizer "
            "wrote gradients: is the model still wrapped in DistributedDataParallel? Remove the "
            "DDP wrapper (this optimizer syncs gradients itself; use optimizer.no_sync() instead "
            "of model.no_sync())"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: grads of backward passes inside are accumulated, not synced.

        The first backward after the context (outside it) syncs the accumulated sum, as DDP's
        ``no_sync``.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- norms and clipping ----------------------------------------------------------------------

    def _grad_factor(self) -> float:
        return 1.0 / (self.world_size * self.redundant_size) if self.average_grad_sync else 1.0

    def _global_sumsq(self) -> torch.Tensor:
        """All-reduced sum of squares of the summed (not yet averaged) grads."""
        if self._sumsq is None:
            self.finish_grad_sync()
            total = torch.zeros(1, dtype=torch.float32, device=self.device)
            for key in self.keys:
                sq, _ = _ops.norm([key.buffers.grad_shard])
                total += sq.to(self.device, torch.float32)
            comm.all_reduce(total, self.process_group)
            self._sumsq = total
        return self._sumsq

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full averaged gradient (loss-scaled if the loss was scaled).

        Collective: every rank must call it. Syncs outstanding grads first.
        """
        return (self._global_sumsq().sqrt() * self._grad_factor()).reshape(())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clips the grads as ``torch.nn.utils.clip_grad_norm_`` would on the full averaged grads.

        The coefficient ``min(1, max_norm / (norm + 1e-6))`` is folded into the kernel's grad scale
        at ``step()`` (no extra pass, no host sync); with a GradScaler the norm is taken on the
        unscaled grads inside the step. Call after the last backward and before ``step()``.

        Returns:
            The total norm before clipping (a device scalar; loss-scaled under a GradScaler).
        """
        self._max_norm = float(max_norm)
        return self.grad_norm()

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):  # noqa: D417
        """Syncs outstanding grads, updates this rank's shard and gathers the params back.

        Args:
            closure: optional callable re-evaluating the model; its loss is returned.
            grad_scaler: passed by ``torch.amp.GradScaler.step``; the overflow decision is the
                same on every rank and the step is skipped everywhere on inf/nan.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_param_sync()
        self.finish_grad_sync()
        scalars = self._step_scalars(grad_scaler)
        for group in self.param_groups:
            if scalars.found_inf_t is None:
                group["step"].add_(1)
            else:
                group["step"].add_(1 - scalars.found_inf_t.reshape(()))
        self._update(scalars)
        self._start_param_sync()
        self._max_norm = None
        self._reset_iteration()
        return loss

    def _step_scalars(self, grad_scaler) -> StepScalars:
        scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        if scaler is not None and self.capturable:
            raise RuntimeError(
                f"{type(self).__name__}: capturable=True does not support a GradScaler (its "
                "update() runs on the host between steps); train in bf16 or without capture"
            )
        grad_scale = torch.full((1,), self._grad_factor(), dtype=torch.float32, device=self.device)
        found_inf = sumsq = None
        if scaler is not None or self._max_norm is not None or self.needs_grad_norm:
            sumsq = self._global_sumsq()
        if scaler is not None:
            scale = scaler._get_scale_async().to(self.device, torch.float32)
            grad_scale = grad_scale * scale.reciprocal().reshape(1)
            found_inf = (~torch.isfinite(sumsq)).float().reshape(1)
            # scaler.update() reads the overflow decision from here
            state = scaler._per_optimizer_states[id(self)]
            state["found_inf_per_device"] = {self.device: found_inf.reshape(())}
        if self._max_norm is not None:
            norm = sumsq.sqrt() * grad_scale  # unscaled, averaged
            grad_scale = grad_scale * torch.clamp(self._max_norm / (norm + 1e-6), max=1.0)
        return StepScalars(grad_scale, found_inf, sumsq)

    def _update(self, scalars: StepScalars) -> None:
        raise NotImplementedError

    def _lr(self, group: dict) -> dict[str, Any]:
        """The kernels' lr arguments: a tensor lr (e.g. for a captured step, where a scheduler
        writes the new value into the tensor) is read on the device, never on the host."""
        lr = group["lr"]
        if torch.is_tensor(lr):
            return {"lr": 0.0, "lr_t": device_lr(lr, self.device)}
        return {"lr": float(lr)}

    def _kernel_scalars(self, group: dict, scalars: StepScalars) -> dict[str, torch.Tensor | None]:
        return {
            "step_t": group["step"].reshape(1),
            "grad_scale_t": scalars.grad_scale_t,
            "found_inf_t": scalars.found_inf_t,
        }

    def _direct_gather(self, key: _Key) -> bool:
        """fp32 params gathered in fp32: the master shard IS this rank's param chunks, so the
        kernel updates the params in place (no out slot) and the all-gather runs in place."""
        return key.buffers.master_is_param

    def _fragment_index(self, key: _Key) -> torch.Tensor:
        """Engine param index of each of this rank's fragments of ``key`` (device vector)."""
        return self._fragment_indices[key.index]

    def _member_index(self, key: _Key) -> torch.Tensor:
        """Engine param indices of every param of ``key`` (device vector)."""
        return self._member_indices[key.index]

    def _outs(self, key: _Key) -> list[torch.Tensor] | None:
        """Per-bucket out slots of the update kernel (None when the gather reads the master)."""
        if self._direct_gather(key):
            return None
        return key.buffers.chunks(key.buffers.sync_space)

    def _fragment_outs(self, key: _Key) -> list[torch.Tensor] | None:
        if self._direct_gather(key):
            return None
        return key.buffers.fragment_outs(key.buffers.sync_space)

    # -- param sync (see Note: one step) ---------------------------------------------------------

    def _start_param_sync(self) -> None:
        """All-gathers every bucket, in forward order (registration order: buckets reversed)."""
        pending: dict[tuple[int, int], comm.Handle] = {}
        for key in self.keys:
            buf = key.buffers
            for bucket in reversed(key.layout.buckets):  # the update wrote this rank's chunk
                pending[(key.index, bucket.index)] = comm.all_gather(
                    buf.bucket(buf.sync_space, bucket),
                    buf.chunk(buf.sync_space, bucket),
                    self.process_group,
                    async_op=True,
                )
        self._param_sync_pending = pending
        if not self.overlap_param_sync:
            self.wait_param_sync()
        else:
            self._install_forward_wait()

    def _finish_bucket_sync(self, ki: int, bi: int) -> None:
        handle = self._param_sync_pending.pop((ki, bi), None)
        if handle is None:
            return
        handle.wait()
        buf = self.keys[ki].buffers
        if buf.sync_space is not buf.param_space:
            bucket = self.keys[ki].layout.buckets[bi]
            buf.bucket(buf.param_space, bucket).copy_(buf.bucket(buf.sync_space, bucket))

    def wait_param_sync(self) -> None:
        """Waits for the param all-gathers of the last step (needed only with
        ``overlap_param_sync=True`` before reading params outside a module forward)."""
        for ki, bi in list(getattr(self, "_param_sync_pending", {})):
            self._finish_bucket_sync(ki, bi)
        if getattr(self, "_forward_hook", None) is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _module_buckets(self, module: torch.nn.Module) -> list[tuple[int, int]]:
        """The (key, bucket) pairs holding a module's own params (cached per module)."""
        cache = self._module_bucket_cache
        found = cache.get(id(module))
        if found is None:
            found = []
            for p in module.parameters(recurse=False):
                i = self.param_index.get(id(p))
                if i is not None:
                    ki = self._param_key[i].index
                    found += [(ki, bi) for bi in self._param_buckets[i] if (ki, bi) not in found]
            cache[id(module)] = found
        return found

    def _install_forward_wait(self) -> None:
        """Before each module's forward, waits only for the buckets holding that module's own
        params, so the all-gathers of later layers overlap the forward of earlier ones. A param
        used outside its own module's forward, before that module has run, must be waited for
        with ``wait_param_sync()``."""
        if getattr(self, "_forward_hook", None) is not None:
            return
        ref = weakref.ref(self)

        def wait_before_forward(module, args):
            opt = ref()
            if opt is None:
                return
            for ki, bi in opt._module_buckets(module):
                opt._finish_bucket_sync(ki, bi)
            if not opt._param_sync_pending and opt._forward_hook is not None:
                opt._forward_hook.remove()
                opt._forward_hook = None

        self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
            wait_before_forward
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops grads accumulated but not yet synced (``no_sync`` micro-batches) and any
        ``param.grad``. After ``step()`` there is nothing to clear: grad buffers are transient."""
        for p in self.all_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._reset_iteration()

    # -- introspection ---------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of every buffer this optimizer holds on its device, summed over keys."""
        out: dict[str, int] = {}
        for key in self.keys:
            for name, n in key.buffers.bytes().items():
                out[name] = out.get(name, 0) + n
        return out

    # -- state dict (torch.optim format, world-size independent) ---------------------------------

    def _shard_tensors(self, key: _Key) -> dict[str, torch.Tensor]:
        """Named shard tensors saved per param: the state, plus masters of low-precision params."""
        named = dict(key.buffers.state)
        if key.param_dtype != self.state_dtype:
            named["master_param"] = key.buffers.master
        return named

    def _restore_groups(self, saved_groups: list[dict[str, Any]]) -> None:
        """Hyperparameters, steps and algorithm extras from JSON-like saved groups (checkpoints)."""
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            for k, v in sg.items():
                if k in self.defaults:
                    _set_hyper(g, k, v)
            g["step"].fill_(float(sg["step"]))  # in place: a captured step keeps its binding
            extra = dict(sg)
            if "exp_avg_sq" in extra:
                extra["exp_avg_sq"] = torch.tensor(extra["exp_avg_sq"], dtype=torch.float32)
            self._load_extra_group_state(gi, extra)

    def _extra_group_state(self, group_index: int) -> dict[str, Any]:
        """Algorithm-specific per-group entries of the state dict (NovoGrad's norms)."""
        return {}

    def _load_extra_group_state(self, group_index: int, saved_group: dict) -> None:
        """Restores what ``_extra_group_state`` saved."""

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The full, world-size independent state in torch.optim's format (same on every rank).

        Built bucket by bucket: each state shard is all-gathered one bucket at a time and copied
        out into per-param CPU tensors, so the device never holds more than one bucket extra.
        Collective: every rank must call it.
        """
        self.wait_param_sync()
        ids = {id(p): i for i, p in enumerate(self.all_params)}
        state: dict[int, dict[str, Any]] = {}
        for key in self.keys:
            named = self._shard_tensors(key)
            for bucket in key.layout.buckets:
                gathered = {}
                for name, shard in named.items():
                    out = torch.empty(bucket.numel, dtype=shard.dtype, device=self.device)
                    comm.all_gather(
                        out,
                        key.buffers.shard_of_bucket(shard, bucket),
                        self.process_group,
                        async_op=False,
                    ).wait()
                    gathered[name] = out.cpu()
                for i in bucket.params:
                    p = self.params[i]
                    space = key.layout.space_ranges[i]
                    piece = space.intersect(bucket.space_range)
                    entry = state.setdefault(ids[id(p)], {})
                    for name, full_bucket in gathered.items():
                        full = entry.setdefault(
                            name, torch.zeros(p.numel(), dtype=full_bucket.dtype)
                        )
                        full[piece.start - space.start : piece.end - space.start].copy_(
                            full_bucket[
                                piece.start - bucket.space_range.start : piece.end
                                - bucket.space_range.start
                            ]
                        )
        groups = []
        for gi, group in enumerate(self.param_groups):
            step = int(group["step"].item())
            saved = {k: v for k, v in group.items() if k not in ("params", "step")}
            saved["step"] = step
            saved["params"] = [ids[id(p)] for p in group["params"]]
            saved.update(self._extra_group_state(gi))
            groups.append(saved)
            for p in group["params"]:
                if ids[id(p)] in state:
                    entry = state[ids[id(p)]]
                    for name in list(entry):
                        entry[name] = entry[name].view(p.shape)
                    entry["step"] = torch.tensor(float(step))
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict from ``state_dict()`` at any world size or bucket size, or one of
        the matching single-process optimizer (FusedAdam, torch.optim.AdamW, ...).

        Each rank copies only the fragments it owns. Hyperparameters and steps are restored.
        """
        saved_groups = state_dict["param_groups"]
        name = type(self).__name__
        check_loaded_groups(saved_groups, self.param_groups, name)
        saved_id: dict[int, Any] = {}
        for group, sg in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], sg["params"]):
                saved_id[id(p)] = pid
                entry = state_dict["state"].get(pid)
                if entry is not None:
                    for key_name, value in entry.items():
                        if (
                            torch.is_tensor(value)
                            and value.dim() > 0
                            and value.numel() != p.numel()
                        ):
                            raise ValueError(
                                f"{name}: state '{key_name}' of param {pid} has {value.numel()} "
                                f"elements, the param has {p.numel()}"
                            )
        for key in self.keys:
            buf = key.buffers
            named = self._shard_tensors(key)
            for f in buf.fragments:
                p = self.params[f.param]
                entry = state_dict["state"].get(saved_id[id(p)], {})
                for sname, shard in named.items():
                    if sname in entry:
                        src = entry[sname]
                    elif sname == "master_param":
                        src = p.detach()
                    else:
                        src = None
                    if src is None:
                        buf.fragment(shard, f).zero_()
                    else:
                        buf.fragment(shard, f).copy_(buf.fragment_param_view(src.detach(), f))
                if "master_param" not in named and not buf.master_is_param:
                    buf.fragment(buf.master, f).copy_(buf.fragment_param_view(p.detach(), f))
        for gi, (group, sg) in enumerate(zip(self.param_groups, saved_groups)):
            for k, v in sg.items():
                if k in ("params", "step") or k not in self.defaults:
                    continue
                _set_hyper(group, k, v)
            if "step" in sg:
                step = float(sg["step"])
            else:
                steps = [
                    float(state_dict["state"][pid]["step"])
                    for pid in sg["params"]
                    if pid in state_dict["state"] and "step" in state_dict["state"][pid]
                ]
                step = max(steps) if steps else 0.0
            group["step"].fill_(step)  # in place: a captured step keeps its binding
            self._load_extra_group_state(gi, sg)
        self._publish_masters()

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state as ShardedTensors for ``torch.distributed.checkpoint`` (collective); see
        ``shardopt.checkpoint.dcp``. Load with ``dcp.load`` then ``load_sharded_state_dict``."""
        from shardopt.checkpoint.dcp import sharded_state_dict

        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finishes a ``torch.distributed.checkpoint.load`` into ``sharded_state_dict()``."""
        from shardopt.checkpoint.dcp import load_sharded_state_dict

        load_sharded_state_dict(self, state_dict)

    @torch.no_grad()
    def _publish_masters(self) -> None:
        """Writes the master shards into the params and all-gathers them (after a load)."""
        for key in self.keys:
            outs = self._fragment_outs(key)  # None: the all-gather reads the masters directly
            for master, out in zip(key.buffers.per_fragment(key.buffers.master), outs or []):
                out.copy_(master)
        self._start_param_sync()
        self.wait_param_sync()
