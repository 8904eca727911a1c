"""Lockstep: what each rank did since the last ``step()``, compared in the step's all-reduces.

Note: lockstep. Every rank must issue the same collectives in the same order: the same
synchronised backward passes (each reduce-scatters every bucket), the same grad-norm calls
(``clip_grad_norm()``, ``grad_norm()``, torch's ``clip_grad_norm_`` routed to the optimizer) and
the same ``step()`` calls. A rank that leaves this (``zero_grad()`` between backward and
``step()`` on one rank, a ``step()`` skipped once, a batch skipped after a caught exception, a
clip the others do not run) pairs its collectives with different ones on the other ranks, which
gloo answers with a SIGABRT ("collective mismatch") and NCCL with a hang or garbage. So what this
rank did rides in every all-reduce of a step interval, all of ONE layout and reduction (``sum``),
so that whichever of them a deviating rank's all-reduce meets, both sides check:

- the step's unused-param flags all-reduce (``GradSync.unused_params``), which ``step()`` runs
  anyway;
- the grad norm's all-reduce (``GradSync.norm_all_reduce``: ``clip_grad_norm()``,
  ``grad_norm()``, a GradScaler's overflow check, LAMB's built-in clipping);
- where a synchronised backward starts after reduce-scatters of this step interval were launched
  (accumulation without ``no_sync``, a backward after a ``zero_grad()`` that dropped synchronised
  grads, or a rank that skipped a ``step()`` and meets the others' norm or step here), the same
  all-reduce with the phase "backward"; this costs one small all-reduce only in those patterns.

The layout (``flags_numel``): one count per param (the ranks that computed a grad for it: 0
means unused), then ``RANK_SLOTS`` slots per rank, each rank writing only its own and zeros
elsewhere, so the sum hands every rank every rank's slots exactly (adding zeros is exact, for
inf and NaN too): the grad norm's partial sum of squares, the param a rank reports as
``failed`` (+1), whether it saw the ranks leave lockstep in an earlier group (HSDP, below), and
the compared values: the phase (step, backward or norm), the steps done
(two exact parts), the synchronised backward passes since the last step and whether
``zero_grad()`` dropped grads already synchronised. The norm is the sum of the ranks' partials
in a fixed order, from the last rank down to rank 0: the order gloo's all-reduce of the one
partial used before (bit-identical to it; checked at worlds 1-4), the same on every rank and
every backend (NCCL's own order depends on its algorithm). No extra collective per step; the
norm's all-reduce, like the step's, is then checked on the host (one host sync, after which the
norm is a device tensor again). A rank whose grads were dropped after their reduce-scatters were
launched launches no more of them in ``step()``.

A rank with no synchronised backward in an iteration in which the others ran one is a mismatch
too: it is what an extra ``step()`` on one rank looks like (that step's collectives pair with the
others' next iteration, and from then on the ranks run one iteration apart, every count equal,
until one of them waits alone at the end), so a rank without a batch must still run a backward
(of a zero loss, as under DDP); every rank stepping after no backward is in lockstep. CPU offload
with updates during backward adds the phase "drop": ``zero_grad()`` after buckets were updated
during backward all-reduces before it all-gathers their params (see Note: updates during backward
in offload_backward.py). On a mismatch every rank of the all-reduce raises ``LockstepError``
(they all read the same sums), naming each rank and what it did; no collective follows the raise
(with HSDP it comes after both groups' all-reduces, below). LAMB's and NovoGrad's per-tensor norm
all-reduces run inside ``step()`` after its checked flags all-reduce, which every rank then passed
together: they cannot meet a deviating rank's check. The check needs the step's flags all-reduce: it
is off with ``skip_unused_params=False`` and under ``capturable`` (the norm is then one plain sum
all-reduce, without a host sync). With a ``redundant_process_group`` (HSDP) each of these
all-reduces runs in the shard group, then in the redundant group, and raises only after both: the
second carries whether a rank saw its shard group leave lockstep, so the other replicas' ranks raise
too (naming the ranks that saw it) instead of waiting at their next collective. The norm is taken
from the shard group's sum (the grads are already summed over the replicas); its check in the
redundant group is one more small all-reduce per norm, with HSDP only. Not covered with a redundant
group: a ``step()`` skipped on one rank (with or without a clip). Its check meets, in the redundant
group, the all-reduce of the grad shards over the replicas that the others' ``step()`` or grad norm
runs before any check (``GradSync.finish``), and gloo aborts; checking before that all-reduce would
cost one more collective per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardopt.zero import comm

PHASE_STEP, PHASE_BACKWARD, PHASE_NORM, PHASE_DROP = 1, 2, 3, 4
#: per-rank slots: the norm's partial sum of squares, a failed param (+1), whether this rank saw
#: the ranks leave lockstep in an earlier group's all-reduce, then the compared values
SLOT_NORM, SLOT_FAILED, SLOT_LEFT = 0, 1, 2
#: values compared: phase, steps done (low and high part, each exact in fp32), passes, dropped
NUM_VALUES = 5
RANK_SLOTS = 3 + NUM_VALUES
_PASSES = 3  # the compared value that counts the synchronised backward passes
_STEP_SPLIT = 2**23


def flags_numel(params: int, world: int) -> int:
    """Elements of the step-interval all-reduce for ``params`` params and ``world`` ranks."""
    return params + world * RANK_SLOTS


class LockstepError(RuntimeError):
    """The ranks did not run the same backward passes, grad-norm and ``step()`` calls."""


@dataclass
class Reduced:
    """What one checked all-reduce of the step-interval layout yields (host tensors)."""

    counts: torch.Tensor  # per param: the ranks that computed a grad for it
    failed: int | None  # the largest param index a rank reported as failed
    sumsq: torch.Tensor  # () float32: the partials summed from the last rank down
    error: str | None  # the LockstepError's message if the ranks left lockstep


@dataclass
class Lockstep:
    """What this rank did since its last ``step()`` (kept across ``zero_grad()``)."""

    owner: str
    steps: int = 0  # step() calls finished
    passes: int = 0  # synchronised backward passes since the last step
    launched: bool = False  # reduce-scatters launched since the last step
    dropped: bool = False  # zero_grad() dropped grads already synchronised

    def stepped(self) -> None:
        self.steps += 1
        self.passes, self.launched, self.dropped = 0, False, False

    def flags(
        self,
        phase: int,
        counts: torch.Tensor,
        failed: int | None,
        group: comm.ProcessGroup | None,
        left: bool = False,
    ) -> torch.Tensor:
        """This rank's contribution to the all-reduce over ``group`` (a host tensor; the norm
        slot, written on the device by the caller, is zero)."""
        n, world, rank = counts.numel(), comm.world_size(group), comm.rank(group)
        out = torch.zeros(flags_numel(n, world), dtype=torch.float32)
        out[:n] = counts
        mine = [0.0, 0.0 if failed is None else float(failed + 1), float(left), float(phase),
                float(self.steps % _STEP_SPLIT), float(self.steps // _STEP_SPLIT),
                float(self.passes), float(self.dropped)]  # fmt: skip
        start = n + rank * RANK_SLOTS
        out[start : start + RANK_SLOTS] = torch.tensor(mine, dtype=torch.float32)
        return out

    def decode(self, reduced: torch.Tensor, n: int, group: comm.ProcessGroup | None) -> Reduced:
        """Decodes the summed flags of ``group``; ``error`` says whether the ranks differ (each
        rank reads the same sums, so all of them see it) or one saw that in an earlier group."""
        world = comm.world_size(group)
        slots = reduced[n:].reshape(world, RANK_SLOTS)
        values = slots[:, SLOT_LEFT + 1 :].tolist()
        error = None
        if any(v != values[0] for v in values):
            passes = {v[_PASSES] for v in values}
            idle = (
                " (a rank without a batch must still run a backward, e.g. of a zero loss, as "
                "under DDP; a step() with no backward on one rank is an extra step())"
                if 0 in passes and len(passes) > 1
                else ""
            )
            error = (
                f"{self.owner}: the ranks left lockstep (every rank must run the same "
                "synchronised backward passes, grad-norm calls (clip_grad_norm(), grad_norm(), "
                "torch's clip_grad_norm_) and step() calls, else their collectives pair with "
                "different ones): "
                + "; ".join(
                    f"rank {comm.global_rank(group, i)} {describe(v)}" for i, v in enumerate(values)
                )
                + f"{idle}. No rank steps; the ranks' state may already differ: restart from a "
                "checkpoint"
            )
        elif slots[:, SLOT_LEFT].any():
            told = [comm.global_rank(group, int(i)) for i in slots[:, SLOT_LEFT].nonzero()]
            error = (
                f"{self.owner}: the ranks of another shard group left lockstep (rank "
                f"{', '.join(map(str, told))} of this replica group saw it; their LockstepError "
                "names what differs). No rank steps; restart from a checkpoint"
            )
        sumsq = slots[world - 1, SLOT_NORM].clone()
        for r in range(world - 2, -1, -1):  # gloo's order (see Note: lockstep)
            sumsq += slots[r, SLOT_NORM]
        reported = int(slots[:, SLOT_FAILED].max().item())
        return Reduced(reduced[:n], reported - 1 if reported else None, sumsq, error)


def describe(values: list[float]) -> str:
    """What a rank did, from its compared values (phase, steps low/high, passes, dropped)."""
    phase, low, high, passes, dropped = (int(v) for v in values)
    steps = high * _STEP_SPLIT + low
    done = f"{passes} synchronised backward pass{'es' if passes != 1 else ''}"
    if phase == PHASE_STEP:
        what = f"is in step() #{steps + 1} after {done}"
    elif phase == PHASE_NORM:
        what = (
            f"is computing the grad norm (clip_grad_norm(), grad_norm() or torch's "
            f"clip_grad_norm_) before step() #{steps + 1} after {done}"
        )
    elif phase == PHASE_DROP:
        what = (
            f"is in zero_grad() before step() #{steps + 1} after {done}, dropping grads that "
            "CPU offload already used to update buckets during backward"
        )
    else:
        what = (
            f"is starting synchronised backward pass {passes + 1} before step() #{steps + 1} "
            "(this rank skipped a step(), or runs a backward the others do not)"
        )
    if dropped:
        what += ", its grads of this step dropped by a zero_grad() before step()"
    return what
