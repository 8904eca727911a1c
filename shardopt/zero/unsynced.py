"""Trainable params that no DistributedFused* optimizer holds, found before the ranks drift apart.

Note: unsynced params. A DistributedFused* optimizer replaces DDP, so nothing syncs the grads of a
trainable param it does not hold. With another optimizer on such params (``torch.optim.Muon`` on
the matrices, ``DistributedFusedAdam`` on the rest, no DDP) each rank would train its own copy and
the ranks drift apart without an error. So each distributed optimizer (above one rank, not under
``capturable``: a captured step has no host sync) compares those params' values across its ranks
at its first ``CHECKED_STEPS`` steps:

- Which params: until then a global forward pre-hook notes the modules that run a forward; the
  outermost of them (the roots: a model, its DDP or ``torch.compile`` wrapper) that hold a param
  of some live DistributedFused* optimizer are the models being trained, and their trainable
  params held by none (nor ``exempt``) are compared. A param is keyed by its root's place among
  those roots (in the order they first ran) and its name in the root, so a module that runs on
  some ranks only (a branch taken on rank 0) does not shift the others' keys; each key is
  compared among the ranks that have it (the union of the ranks' keys).
- What is compared: a fingerprint of the value's bits (the sum of the elements' bit patterns and
  of their squares, in wrapping int64 arithmetic: exact, so equal values match on any CPU ISA or
  device and in any order). Values, not grads: a param nobody steps may well have differing
  grads. Values differ once another optimizer stepped on differing grads (or the ranks started
  from different values), so a drift shows at this optimizer's first or second step, as the
  other optimizer steps before or after it.
- When: in ``step()`` right after the unused-param flags all-reduce that carries the lockstep
  check (Note: lockstep in lockstep.py), so a rank out of lockstep meets that check, never this
  comparison; the ranks reach it together. One ``all_gather_object`` of the keys and
  fingerprints per checked step (with HSDP one in the shard group, then one in the redundant
  group carrying the shard group's, so every rank sees every rank's), then the hook is removed
  and nothing runs again.
- The verdict: every rank sees the same fingerprints, so where some differ every rank raises
  ``UnsyncedParamsError`` naming them and the fixes, before the step changes anything (with
  ``CPUOffload(overlap_backward=...)`` the buckets already updated during that backward keep
  their update). Params that match pass, whatever syncs them (DDP on a submodule, a manual
  all-reduce of their grads). Params meant to differ across ranks (experts of expert parallelism
  stepped by another optimizer) are passed to ``exempt``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from shardopt.zero import comm

#: the steps at whose start the params are compared (another optimizer's first step on
#: differing grads shows at the first or the second, as it runs before or after this one)
CHECKED_STEPS = 2
#: elements fingerprinted per kernel call (bounds the int64 temporaries: 32 MiB each)
_CHUNK = 1 << 22
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: the live distributed optimizers with a check (their params are the held ones)
_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()
#: id -> weak reference of each param passed to ``exempt``
_EXEMPT: dict[int, weakref.ref] = {}


class UnsyncedParamsError(RuntimeError):
    """Trainable params no DistributedFused* optimizer holds differ across ranks."""


def exempt(params: Iterable[torch.Tensor]) -> None:
    """Marks params that may differ across ranks (Note: unsynced params): the first steps'
    comparison skips them.

    Args:
        params: the params (e.g. the experts of expert parallelism, which another optimizer
            steps and which are meant to differ across the data-parallel ranks).

    Example::

        from shardopt.zero import unsynced
        unsynced.exempt(model.experts.parameters())
        opt = shardopt.DistributedFusedAdam(dense_params, lr=1e-3)
    """
    for p in params:
        _EXEMPT[id(p)] = weakref.ref(p)


def _marked(p: torch.Tensor, registry: dict[int, weakref.ref]) -> bool:
    ref = registry.get(id(p))
    return ref is not None and ref() is p


def fingerprint(p: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers (device tensor) that equal values share on any device and ISA: the
    wrapping sums of the elements' bit patterns and of their squares."""
    t = p.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    bits = t.reshape(-1).view(_BITS[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].long()
        out[0] += chunk.sum()
        out[1] += (chunk * chunk).sum()
    return out


def _roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules (in the order given) that are no other given module's descendant."""
    inside: set[int] = set()
    for m in modules:
        inside.update(id(c) for c in m.modules() if c is not m)
    return [m for m in modules if id(m) not in inside]


class UnsyncedCheck:
    """One optimizer's watch of the modules that run a forward, and the comparison."""

    def __init__(self, optimizer) -> None:
        redundant = optimizer.redundant_process_group
        groups = [optimizer.process_group] + ([redundant] if redundant is not None else [])
        self.owner = type(optimizer).__name__
        self.groups = [g for g in groups if comm.world_size(g) > 1]
        self._optimizer = weakref.ref(optimizer)
        self._modules: dict[int, weakref.ref] = {}
        self._steps = 0
        self._hook = None
        _OPTIMIZERS.add(optimizer)
        if not self.groups or optimizer.config.capturable:
            return
        ref = weakref.ref(self)

        @torch.compiler.disable  # see Note: torch.compile (shardopt/zero/engine.py)
        def note(module, args):
            check = ref()
            if check is not None and id(module) not in check._modules:
                check._modules[id(module)] = weakref.ref(module)

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(note)
        weakref.finalize(self, self._hook.remove)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def candidates(self) -> dict[str, tuple[str, torch.Tensor]]:
        """key -> (name shown, param) of the params compared (Note: unsynced params)."""
        held: set[int] = set()
        for opt in list(_OPTIMIZERS):
            if not opt.closed:
                held.update(id(p) for p in opt.params)
        seen = [m for r in self._modules.values() if (m := r()) is not None]
        roots = [r for r in _roots(seen) if any(id(p) in held for p in r.parameters())]
        found: dict[str, tuple[str, torch.Tensor]] = {}
        taken: set[int] = set()
        for i, root in enumerate(roots):
            where = f" of {type(root).__name__} #{i}" if len(roots) > 1 else ""
            for name, p in root.named_parameters():
                if not p.requires_grad or id(p) in held or id(p) in taken:
                    continue
                if _marked(p, _EXEMPT):
                    continue
                taken.add(id(p))
                found[f"{i}:{name}"] = (f"{name} {tuple(p.shape)}{where}", p)
        return found

    def check(self) -> None:
        """``step()``, after its lockstep check, at its first ``CHECKED_STEPS`` calls
        (collective: every rank's step reaches it): raises ``UnsyncedParamsError`` on every rank
        where the compared params differ."""
        if self._hook is None:
            return
        self._steps += 1
        if self._steps >= CHECKED_STEPS:
            self.close()
        found = self.candidates()
        prints = [fingerprint(p) for _, p in found.values()]
        values = torch.stack(prints).cpu().tolist() if prints else []  # one host sync
        mine = {key: tuple(fp) for key, fp in zip(found, values)}
        every: list[dict] = [mine]
        for group in self.groups:  # HSDP: the shard group's, then over the replicas
            every = [d for part in comm.all_gather_object(every, group) for d in part]
        keys = {key for d in every for key in d}
        differ = sorted(k for k in keys if len({d[k] for d in every if k in d}) > 1)
        if not differ:
            return
        names = [found[k][0] if k in found else k.split(":", 1)[1] for k in differ]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise UnsyncedParamsError(
            f"{self.owner}: {len(names)} trainable param{'s' if len(names) != 1 else ''} that "
            f"no DistributedFused* optimizer holds differ across ranks ({shown}). Nothing syncs "
            "their grads (a DistributedFused* optimizer replaces DDP), so each rank trains its "
            "own copy. Either give them to a DistributedFused* optimizer (another param group, "
            "or a second one), or wrap the submodule holding only them in DDP, or sync them "
            "yourself: broadcast their values once and average their grads "
            "(torch.distributed.all_reduce(p.grad, op=ReduceOp.AVG)) before their optimizer "
            "steps. Params meant to differ across ranks: shardopt.zero.unsynced.exempt(params). "
            "No rank stepped (see docs/migration.md, params no optimizer syncs)"
        )
