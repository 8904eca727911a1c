"""Lockstep: what each rank did since the last ``step()``, compared in the step's flags all-reduce.

Note: lockstep. Every rank must issue the same collectives in the same order: the same
synchronised backward passes (each reduce-scatters every bucket) and the same ``step()`` calls.
A rank that leaves this (``zero_grad()`` between backward and ``step()`` on one rank, a
``step()`` skipped once, a batch skipped after a caught exception) pairs its collectives with
different ones on the other ranks, which gloo answers with a SIGABRT ("collective mismatch")
and NCCL with a hang or garbage. So a few numbers ride in the all-reduce of the unused-param
flags that ``step()`` already runs (``GradSync.unused_params``): the phase (in ``step()``, or
starting a further synchronised backward), the steps done, the synchronised backward passes
since the last step and whether ``zero_grad()`` dropped grads already synchronised. Each value
goes in twice, as v and -v, so the max all-reduce yields its maximum and minimum over ranks:
equal means lockstep. No extra collective per step. Two points keep the collectives paired
until that all-reduce:

- a synchronised backward that starts after reduce-scatters of this step interval were launched
  (accumulation without ``no_sync``, or a backward after such a ``zero_grad()``) first runs the
  same all-reduce with the phase "backward" (ranks that skipped a ``step()`` meet the others'
  step there); this costs one small all-reduce only in those patterns;
- a rank whose grads were dropped after their reduce-scatters were launched launches no more
  of them in ``step()``.

A rank with no backward at all in an iteration is not a mismatch: it contributes zero grads
(see docs/spec.md, DDP equivalence). On a mismatch every rank that took part raises
``LockstepError``, naming each rank and what it did (one all-gather, on the error path only).
The check needs that all-reduce: it is off with ``skip_unused_params=False`` and under
``capturable``. Not covered: a ``step()`` skipped on one rank when the others call
``clip_grad_norm()`` or ``grad_norm()`` before their ``step()``: the deviating rank's check
meets the norm's all-reduce, not the step's (riding on that one too would need both to share one
shape and reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardopt.zero import comm

PHASE_STEP, PHASE_BACKWARD = 1, 2
#: values compared: phase, steps done (mod 2**23: exact in fp32), passes, dropped
NUM_VALUES = 4
#: slots in the all-reduced vector: each value and its negation, plus the smallest nonzero
#: pass count (negated) so that a rank without any backward is not a mismatch
NUM_SLOTS = 2 * NUM_VALUES + 1
_STEP_MOD = 2**23
_NO_PASS = float(2**23)


class LockstepError(RuntimeError):
    """The ranks did not run the same backward passes and ``step()`` calls."""


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

    def _values(self, phase: int) -> list[float]:
        return [float(phase), float(self.steps % _STEP_MOD), float(self.passes),
                float(self.dropped)]  # fmt: skip

    def encode(self, phase: int, out: torch.Tensor) -> None:
        """Writes this rank's slots into ``out`` (NUM_SLOTS values, then max-all-reduced)."""
        values = self._values(phase)
        out.copy_(
            torch.tensor(
                values + [-v for v in values] + [-(float(self.passes) or _NO_PASS)],
                dtype=out.dtype,
            )
        )

    def check(self, phase: int, reduced: torch.Tensor, group: comm.ProcessGroup | None) -> None:
        """Raises ``LockstepError`` on every rank of the all-reduce if the ranks differ."""
        r = reduced.cpu().tolist()
        top, bottom = r[:NUM_VALUES], [-v for v in r[NUM_VALUES : 2 * NUM_VALUES]]
        fewest = -r[2 * NUM_VALUES]
        same = all(a == b for i, (a, b) in enumerate(zip(top, bottom)) if i != 2)
        passes_ok = top[2] == bottom[2] or fewest in (top[2], _NO_PASS)
        if same and passes_ok:
            return
        everyone = comm.all_gather_object(self.describe(phase), group)
        raise LockstepError(
            f"{self.owner}: the ranks left lockstep (every rank must run the same synchronised "
            "backward passes and step() calls, else their collectives pair with different "
            "ones): "
            + "; ".join(f"rank {i} {d}" for i, d in enumerate(everyone))
            + ". No rank steps; the ranks' state may already differ: restart from a checkpoint"
        )

    def describe(self, phase: int) -> str:
        passes = f"{self.passes} synchronised backward pass{'es' if self.passes != 1 else ''}"
        if phase == PHASE_STEP:
            what = f"is in step() #{self.steps + 1} after {passes}"
        else:
            what = (
                f"is starting synchronised backward pass {self.passes + 1} before step() "
                f"#{self.steps + 1} (this rank skipped a step(), or runs a backward the others "
                "do not)"
            )
        if self.dropped:
            what += ", its grads of this step dropped by a zero_grad() before step()"
        return what
