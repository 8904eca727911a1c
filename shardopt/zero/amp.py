"""Loss scaling and clipping: the global grad norm and the one device scalar the kernels read.

Averaging over ranks, the inverse loss scale of a ``torch.amp.GradScaler`` and the clip
coefficient fold into one device scalar ``grad_scale_t`` the update kernels multiply every grad
element by (no extra pass over the grads, no host sync). The overflow decision comes from the
all-reduced sum of squares of the grads, so it is the same on every rank.

GradScaler: this optimizer owns its grads (they live in its buckets, not in ``param.grad``), so it
sets ``_step_supports_amp_scaling`` and receives the scaler in ``step(grad_scaler=...)``, the
contract torch documents for such optimizers. torch offers such an optimizer no public way to
read the scale without a host sync or to report its inf/nan decision to ``scaler.update()``;
``_ScalerLink`` is the one place that touches the scaler's internals for that.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from shardopt import kernels as _ops
from shardopt.zero import comm
from shardopt.zero.grad_sync import GradSync
from shardopt.zero.sharded_params import ShardedParams


@dataclass
class StepScalars:
    """Device scalars of one step, shared by every key's update."""

    grad_scale_t: torch.Tensor  # averaging x inverse loss scale x clip coefficient
    found_inf_t: torch.Tensor | None
    sumsq: torch.Tensor | None  # all-reduced sum of squares of the summed grads (if computed)


class _ScalerLink:
    """What this optimizer reads from and reports to a GradScaler (see the module docstring)."""

    def __init__(self, scaler, device: torch.device) -> None:
        self.scaler = scaler
        self.device = device

    def scale(self) -> torch.Tensor:
        """The current loss scale as a device tensor (no host sync)."""
        return self.scaler._get_scale_async().to(self.device, torch.float32).reshape(1)

    def unscaled(self, optimizer) -> bool:
        """Whether ``scaler.unscale_(optimizer)`` was called in this iteration."""
        from torch.amp.grad_scaler import OptState

        state = self.scaler._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is OptState.UNSCALED

    def report(self, optimizer, found_inf: torch.Tensor) -> None:
        """Hands the overflow decision to ``scaler.update()``."""
        state = self.scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {self.device: found_inf.reshape(())}


class AmpClip:
    """The grad norm, clipping and loss-scale handling of one iteration."""

    def __init__(
        self,
        sharded: ShardedParams,
        grad_sync: GradSync,
        *,
        process_group: comm.ProcessGroup | None,
        grad_factor: float,
        capturable: bool,
    ) -> None:
        self.sharded = sharded
        self.grad_sync = grad_sync
        self.process_group = process_group
        self.grad_factor = grad_factor  # 1/ranks when averaging, else 1
        self.capturable = capturable
        #: the GradScaler last handed to step() (to answer clip_grad_norm after unscale_)
        self._scaler = None
        self._searched = False
        self.reset()

    def reset(self) -> None:
        self.max_norm: float | None = None
        self._sumsq: torch.Tensor | None = None

    def global_sumsq(self) -> torch.Tensor:
        """All-reduced sum of squares of the summed (not yet averaged) grads (cached)."""
        if self._sumsq is None:
            self.grad_sync.finish()
            device = self.sharded.device
            total = torch.zeros(1, dtype=torch.float32, device=device)
            for key in self.sharded.keys:
                sq, _ = _ops.norm([key.buffers.grad_shard])
                total += sq.to(device, torch.float32)
            comm.all_reduce(total, self.process_group)
            self._sumsq = total
        return self._sumsq

    def grad_norm(self) -> torch.Tensor:
        return (self.global_sumsq().sqrt() * self.grad_factor).reshape(())

    def clip(self, optimizer, max_norm: float, grad_scaler=None) -> torch.Tensor:
        """Arms clipping for the next step; the norm before clipping, unscaled when
        ``scaler.unscale_(optimizer)`` was called (the scaler is the one given, else the one
        the last step received), as ``torch.nn.utils.clip_grad_norm_`` returns it."""
        self.max_norm = float(max_norm)
        norm = self.grad_norm()
        scaler = grad_scaler if grad_scaler is not None else self._scaler
        if scaler is None and not self._searched:
            scaler = self._search_scaler(optimizer)
        if scaler is not None and scaler.is_enabled():
            link = _ScalerLink(scaler, self.sharded.device)
            if link.unscaled(optimizer):
                norm = norm / link.scale().reshape(())
        return norm

    def _search_scaler(self, optimizer):
        """The first clip of a run, before any step() handed the scaler over: the GradScaler
        that ``unscale_``-d this optimizer, found once among the live objects."""
        self._searched = True
        for obj in gc.get_objects():
            # type(), not isinstance(): a dead weakref.proxy raises on any attribute access
            if issubclass(type(obj), torch.amp.GradScaler) and obj.is_enabled():
                if _ScalerLink(obj, self.sharded.device).unscaled(optimizer):
                    self._scaler = obj
                    return obj
        return None

    def step_scalars(self, optimizer, grad_scaler, needs_grad_norm: bool) -> StepScalars:
        """The scalars of this step; reports the overflow decision to the scaler."""
        scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        if scaler is not None and self.capturable:
            raise RuntimeError(
                f"{self.sharded.owner}: capturable=True does not support a GradScaler (its "
                "update() runs on the host between steps); train in bf16 or without capture"
            )
        device = self.sharded.device
        grad_scale = torch.full((1,), self.grad_factor, dtype=torch.float32, device=device)
        found_inf = sumsq = None
        if scaler is not None or self.max_norm is not None or needs_grad_norm:
            sumsq = self.global_sumsq()
        if scaler is not None:
            self._scaler = scaler
            link = _ScalerLink(scaler, device)
            grad_scale = grad_scale * link.scale().reciprocal()
            found_inf = (~torch.isfinite(sumsq)).float().reshape(1)
            link.report(optimizer, found_inf)
        if self.max_norm is not None:
            norm = sumsq.sqrt() * grad_scale  # unscaled, averaged
            grad_scale = grad_scale * torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        return StepScalars(grad_scale, found_inf, sumsq)
