"""The base of every algorithm's ``Hyperparams``: a frozen dataclass of constructor arguments.

An algorithm's dataclass lists its hyperparameters in the order of the param-group entries (the
constructors keep Apex's positional order, which the test of the pairs checks), with the
defaults both of its classes take (``FusedX`` and ``DistributedFusedX`` write
``lr: float = adam.Hyperparams.lr``, so a default exists once). ``validate`` is torch.optim's
constructor check with its messages; ``group_defaults`` is what goes into every param group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardopt.algorithms.validation import check_hyperparams

#: metadata of a field that is a constructor argument but no param-group entry (e.g. ``amsgrad``)
CONSTRUCTOR_ONLY = {"in_group": False}


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """Base of the algorithms' hyperparameter dataclasses (no fields of its own)."""

    def group_defaults(self) -> dict[str, Any]:
        """The param-group entries of these hyperparameters: every field not marked
        ``CONSTRUCTOR_ONLY``, its value as given (a tensor lr stays that tensor, not a copy)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("in_group", True)
        }

    def validate(self, owner: str) -> None:
        """Raises what torch.optim's constructors raise for these hyperparameters, naming
        ``owner`` (the class): the algorithm's own checks first, then the common ones.

        Raises:
            RuntimeError, TypeError, ValueError: see ``_check`` and ``check_hyperparams``.
        """
        self._check(owner)
        check_hyperparams(self.group_defaults(), owner)

    def _check(self, owner: str) -> None:
        """The algorithm's own checks (run before the common ones)."""


def constructor_only(default: Any) -> Any:
    """A dataclass field with ``default`` that is not a param-group entry."""
    return dataclasses.field(default=default, metadata=CONSTRUCTOR_ONLY)
