"""fp32 masters of the single-process optimizers that follow writes into their params.

Note: the params are the truth (single-process)
``FusedAdam(master_weights=True)``, ``FusedLAMB(master_weights=True)`` and
``FusedMixedPrecisionLamb`` update an fp32 master of each fp16/bf16 param and write the rounded
master into the param. A write into the param between steps (``model.load_state_dict``, an
in-place init, a param loaded by a checkpoint library) must be where the next step starts, as in
torch.optim (which keeps no master): a stale master must not undo it. As in the distributed
engine (shardopt/zero/engine.py), writes are seen through each param's version counter: the
kernels write params without moving it, so a counter that moved since the last step is a write
by someone else. That master is then kept only where it still rounds to the param (an fp32
master value the param was rounded from is worth keeping), else it takes the param's value.

The check per step is two C-level ``map`` loops over a group's params (their ids and version
counters against the ones recorded), no pass over the data; only a changed param costs a device
op. Versions are recorded against one ``optimizer.state`` object: ``load_state_dict`` installs a
new one, so every loaded master is checked against the params at the next step. Writes through
``p.data`` bypass the counter and are not seen, and neither is anything under ``torch.compile``
(a compiled ``step()`` cannot read version counters: there the masters are kept as they are, as
before this check existed).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch

_VERSION = operator.attrgetter("_version")


class ParamVersions:
    """The version counter of each param as the last step left it (see the module's Note)."""

    def __init__(self) -> None:
        self._state: object = None  # the optimizer.state the versions were recorded against
        self._seen: dict[int, int] = {}  # id(param) -> version

    def follow(
        self,
        state: dict,
        params: list[torch.Tensor],
        keeps_master: Callable[[torch.Tensor], bool],
    ) -> None:
        """Re-seeds the masters in ``state`` of the params written since the last step."""
        if state is not self._state:
            self._state, self._seen = state, {}
        seen = self._seen
        if list(map(seen.get, map(id, params))) == list(map(_VERSION, params)):
            return
        for p in params:
            if seen.get(id(p)) == p._version or not keeps_master(p):
                continue
            entry = state.get(p)
            master = entry.get("master_param") if entry else None
            if master is not None:  # none yet: the step creates it from the param
                with torch.no_grad():
                    master.copy_(merge_master(master, p.detach()))

    def record(self, state: dict, params: Iterable[torch.Tensor]) -> None:
        """Notes the params' versions after the step wrote them."""
        if state is not self._state:
            self._state, self._seen = state, {}
        params = list(params)
        self._seen.update(zip(map(id, params), map(_VERSION, params)))


def merge_master(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``master`` where it rounds to ``param``'s value, else the param's value in fp32."""
    return torch.where(master.to(param.dtype) == param, master, param.to(master.dtype))
