"""Loss scaling and clipping: the global grad norm and the one device scalar the kernels read.

Averaging over ranks, the inverse loss scale of a ``torch.amp.GradScaler`` and the clip
coefficient fold into one device scalar ``grad_scale_t`` the update kernels multiply every grad
element by (no extra pass over the grads, no host sync). The overflow decision comes from the
all-reduced sum of squares of the grads, so it is the same on every rank. That all-reduce has the
layout of the step's flags all-reduce and carries the lockstep check (see Note: lockstep).

GradScaler: this optimizer owns its grads (they live in its buckets, not in ``param.grad``), so it
sets ``_step_supports_amp_scaling`` and receives the scaler in ``step(grad_scaler=...)``, the
contract torch documents for such optimizers. ``_ScalerLink`` talks to the scaler through its
public methods only: the loss scale is ``scaler.scale(ones)`` (a device tensor, no host sync),
and the overflow decision reaches ``scaler.update()`` through ``scaler.unscale_`` of a one-element
probe optimizer whose grad is the all-reduced sum of squares (non-finite exactly when a grad is).
The optimizer's grads are never unscaled in place, so ``clip()`` returns the unscaled norm whenever
it knows a scaler: the one given to it, else the last one that ``unscale_``-d this optimizer, else
the one the last ``step()`` received. That is the norm the step clips by. The scaler cannot be
asked which optimizers it unscaled, and ``unscale_`` finds no ``.grad`` on our params, so
``hook_unscale()`` wraps the public ``GradScaler.unscale_`` (once per process, when the first
optimizer is built) to tell the optimizer it was handed over. Without it, the first clip of a run,
before any ``step()``, would not know the scaler and would return the loss-scaled norm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardopt import kernels
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

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ones = torch.ones(1, dtype=torch.float32, device=device)
        # the scaler records found_inf per optimizer it unscaled; this one carries ours
        self._flag = torch.zeros(1, dtype=torch.float32, device=device)
        self._probe = torch.optim.SGD([self._flag], lr=0.0)

    def scale(self, scaler) -> torch.Tensor:
        """The current loss scale as a device tensor (no host sync)."""
        return scaler.scale(self._ones).to(self.device, torch.float32).reshape(1)

    def report(self, scaler, sumsq: torch.Tensor) -> None:
        """Hands the overflow decision (``sumsq`` not finite) to ``scaler.update()``."""
        self._flag.grad = sumsq.detach().to(self.device, torch.float32).reshape(1).clone()
        scaler.unscale_(self._probe)


def _subclasses(cls: type) -> list[type]:
    """``cls`` and every subclass defined so far."""
    found = [cls]
    for sub in cls.__subclasses__():
        found += [c for c in _subclasses(sub) if c not in found]
    return found


def _hooked_unscale(original):
    """``unscale_`` that also tells a DistributedFused* optimizer which scaler unscaled it."""

    @functools.wraps(original)
    def unscale_(scaler, optimizer):
        original(scaler, optimizer)
        amp = getattr(optimizer, "amp", None)
        if isinstance(amp, AmpClip):
            amp.unscaled_by(scaler)

    unscale_.shardopt_hooked = True
    return unscale_


def hook_unscale() -> None:
    """Wraps ``unscale_`` of ``torch.amp.GradScaler`` and of its subclasses defined so far that
    override it (``torch.cuda.amp.GradScaler`` inherits it), once per class: the first clip of a
    run then knows the scaler (see the module docstring)."""
    for cls in _subclasses(torch.amp.GradScaler):
        original = vars(cls).get("unscale_")
        if original is not None and not getattr(original, "shardopt_hooked", False):
            cls.unscale_ = _hooked_unscale(original)


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
        #: the GradScaler that last unscale_-d this optimizer or was handed to step() (clip()
        #: returns the norm it unscales)
        self._scaler = None
        self._link = _ScalerLink(sharded.device)
        hook_unscale()
        self.reset()

    def unscaled_by(self, scaler) -> None:
        """``scaler.unscale_(optimizer)`` ran: the grads clip() sees are unscaled by it."""
        self._scaler = scaler

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
                sq, _ = kernels.norm([key.buffers.grad_shard])
                total += sq.to(device, torch.float32)
            if self.grad_sync.checks_lockstep:  # carries the check (see Note: lockstep)
                total = self.grad_sync.norm_all_reduce(total)
            else:
                comm.all_reduce(total, self.process_group)
            self._sumsq = total
        return self._sumsq

    def check_open(self, what: str) -> None:
        """Raises after ``close()``: the hooks are gone, so grads land in ``.grad`` and the
        optimizer would blame another writer (a DDP wrapper) for them."""
        if self.grad_sync.closed:
            raise RuntimeError(
                f"{self.sharded.owner}: {what}() after close(): the optimizer no longer syncs "
                "grads (its params are plain tensors again); build a new one"
            )

    def grad_norm(self) -> torch.Tensor:
        self.check_open("grad_norm")
        return (self.global_sumsq().sqrt() * self.grad_factor).reshape(())

    def clip(self, optimizer, max_norm: float, grad_scaler=None) -> torch.Tensor:
        """Arms clipping for the next step; returns the norm before clipping, unscaled when a
        GradScaler is known (``grad_scaler``, else the last one that unscaled this optimizer or
        that a step received): the norm of the grads ``step()`` clips, as
        ``torch.nn.utils.clip_grad_norm_`` returns it after ``scaler.unscale_(optimizer)``."""
        self.check_open("clip_grad_norm")
        self.max_norm = float(max_norm)
        norm = self.grad_norm()
        scaler = grad_scaler if grad_scaler is not None else self._scaler
        if scaler is not None and scaler.is_enabled():
            norm = norm / self._link.scale(scaler).reshape(())
        return norm

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
            grad_scale = grad_scale * self._link.scale(scaler).reciprocal()
            found_inf = (~torch.isfinite(sumsq)).float().reshape(1)
            self._link.report(scaler, sumsq)
        if self.max_norm is not None:
            norm = sumsq.sqrt() * grad_scale  # unscaled, averaged
            grad_scale = grad_scale * torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        return StepScalars(grad_scale, found_inf, sumsq)
