"""Mixed-precision LAMB: LAMB's definition (shardopt/algorithms/lamb.py) plus the initial step
and the dtype whose params get fp32 masters; its update is LAMB's two stages."""

from __future__ import annotations

import dataclasses
import numbers

import torch

from shardopt.algorithms import hyperparams, lamb

#: the dtypes ``reduced_precision_dtype`` may name
REDUCED_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Hyperparams(lamb.Hyperparams):
    """LAMB's hyperparameters and defaults, plus two constructor arguments of its own (neither a
    param-group entry). Apex's positional order puts ``step`` right after ``lr``; the
    constructor lists it there.

    Attributes:
        step: initial step count (stored as a device tensor per group).
        reduced_precision_dtype: fp16, bf16 or None; params of this dtype get fp32 masters and
            fp32 state.
    """

    step: int = hyperparams.constructor_only(0)
    reduced_precision_dtype: torch.dtype | None = hyperparams.constructor_only(None)

    def _check(self, owner: str) -> None:
        if self.reduced_precision_dtype not in (None, *REDUCED_PRECISION):
            raise ValueError(
                f"reduced_precision_dtype must be torch.float16, torch.bfloat16 or None, got "
                f"{self.reduced_precision_dtype}"
            )
        if not isinstance(self.step, numbers.Real) and not torch.is_tensor(self.step):
            raise TypeError(
                f"{owner}: step got {self.step!r}, which looks like betas. Apex's "
                f"positional order is {owner}(params, lr, step, bias_correction, "
                "betas, eps, ...), unlike torch.optim.Adam(params, lr, betas, eps, ...); pass "
                "betas=... (and the other hyperparameters) by keyword"
            )
        super()._check(owner)
