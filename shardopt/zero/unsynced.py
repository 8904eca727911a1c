"""Trainable params that no DistributedFused* optimizer holds, found before the ranks drift apart.

Note: unsynced params. A DistributedFused* optimizer replaces DDP, so nothing syncs the grads of a
trainable param it does not hold. With another optimizer on such params (``torch.optim.Muon`` on
the matrices and ``DistributedFusedAdam`` on the rest, no DDP) each rank would train its own copy
and the ranks drift apart without an error. So, until its first ``CHECKED_STEPS`` steps, every
distributed optimizer notes each module that runs a forward (a global forward pre-hook, removed
after them), and at each of those steps compares, across its ranks, fingerprints of the values
of the trainable params of those modules that no DistributedFused* optimizer holds (their sum and
absolute sum in fp64: one small all-gather a step, then never again). Values, not grads: a param
nobody steps may well have differing grads. The values differ once another optimizer has taken a
step on differing grads, so the drift is caught at the first or second step of this optimizer,
whichever follows that step. Params equal on every rank pass, whatever syncs them (a DDP-wrapped
submodule, a manual all-reduce of their grads); params that differ raise
``UnsyncedParamsError`` on every rank (each rank sees every rank's fingerprints, so all decide
alike), naming them and the fixes, before the step changes anything.
"""

from __future__ import annotations

import weakref

import torch

from shardopt.zero import comm

#: the steps at whose start the params are compared (another optimizer's first step on
#: differing grads shows before the first or the second, as it runs before or after this one)
CHECKED_STEPS = 2

#: id -> weak reference of every param a DistributedFused* optimizer holds (all optimizers of
#: the process; by id, since a tensor's ``==`` is elementwise and a WeakSet compares with it)
_HELD: dict[int, weakref.ref] = {}


def _held(p: torch.Tensor) -> bool:
    ref = _HELD.get(id(p))
    return ref is not None and ref() is p


class UnsyncedParamsError(RuntimeError):
    """Trainable params no DistributedFused* optimizer holds differ across ranks."""


def _fingerprint(p: torch.Tensor) -> tuple:
    with torch.no_grad():
        value = p.detach().double()
        return tuple(p.shape), float(value.sum()), float(value.abs().sum())


class UnsyncedCheck:
    """One optimizer's watch of the modules that run a forward, and the comparison."""

    def __init__(self, owner: str, params, groups: list[comm.ProcessGroup | None]) -> None:
        for dead in [i for i, ref in _HELD.items() if ref() is None]:
            del _HELD[dead]
        for p in params:
            _HELD[id(p)] = weakref.ref(p)
        self.owner = owner
        self.groups = [g for g in groups if comm.world_size(g) > 1]
        self._modules: dict[int, weakref.ref] = {}
        self._steps = 0
        self._hook = None
        if self.groups:
            ref = weakref.ref(self)

            @torch.compiler.disable  # see Note: torch.compile (shardopt/zero/engine.py)
            def note(module, args):
                check = ref()
                if check is not None and id(module) not in check._modules:
                    check._modules[id(module)] = weakref.ref(module)

            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(note)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _candidates(self) -> list[tuple[str, torch.Tensor]]:
        """(name, param) of the trainable params of the modules seen, held by no optimizer."""
        found, seen = [], set()
        for module_ref in self._modules.values():
            module = module_ref()
            if module is None:
                continue
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and not _held(p) and id(p) not in seen:
                    seen.add(id(p))
                    found.append((f"{type(module).__name__}.{name}", p))
        return found

    def check(self) -> None:
        """At the start of each of the first ``CHECKED_STEPS`` steps (collective: every rank's
        step calls it): raises ``UnsyncedParamsError`` on every rank where such params differ."""
        if self._hook is None:
            return
        self._steps += 1
        if self._steps >= CHECKED_STEPS:
            self.close()
        candidates = self._candidates()
        mine = [_fingerprint(p) for _, p in candidates]
        differ: set[int] = set()
        for group in self.groups:
            every = comm.all_gather_object(mine, group)
            if any(len(other) != len(mine) for other in every):
                raise UnsyncedParamsError(
                    f"{self.owner}: the ranks ran forwards over different modules with params "
                    "no DistributedFused* optimizer holds (see Note: unsynced params)"
                )
            differ |= {i for i in range(len(mine)) if any(o[i] != mine[i] for o in every)}
        if differ:
            names = [f"{candidates[i][0]} {tuple(candidates[i][1].shape)}" for i in sorted(differ)]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise UnsyncedParamsError(
                f"{self.owner}: {len(names)} trainable params held by no DistributedFused* "
                f"optimizer differ across ranks ({shown}): nothing syncs their grads (a "
                "DistributedFused* optimizer replaces DDP), so each rank trains its own copy. "
                "Give them to a DistributedFused* optimizer (another param group or another "
                "optimizer), or average their grads yourself before their optimizer steps "
                "(torch.distributed.all_reduce(p.grad, op=ReduceOp.AVG)) after broadcasting "
                "their values once"
            )
