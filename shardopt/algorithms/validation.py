"""torch.optim's constructor checks, with its messages, for every algorithm's hyperparameters.

Both class families (``FusedX`` and ``DistributedFusedX``) run them through their algorithm's
``Hyperparams.validate``, so the same bad argument gives the same error in both.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

# Apex's positional order puts bias_correction where torch.optim.Adam has betas.
APEX_ORDER = (
    "{owner}: {arg} got {value!r}, which looks like betas. Apex's positional order is "
    "{owner}(params, lr, {order}betas, eps, ...), unlike torch.optim.Adam(params, lr, betas, eps, "
    "...); pass betas=... (and the other hyperparameters) by keyword"
)


def _value(x: Any) -> Any:
    """A 1-element tensor hyperparameter as a Python number (read once, at construction)."""
    if torch.is_tensor(x) and x.numel() == 1 and x.device.type != "meta":
        return x.item()
    return x


def reject_amsgrad(amsgrad: bool, owner: str) -> None:
    """RuntimeError for ``amsgrad=True`` (no class implements AMSGrad, as Apex's)."""
    if amsgrad:
        raise RuntimeError(f"{owner} does not support the AMSGrad variant.")


def check_hyperparams(defaults: dict[str, Any], owner: str) -> None:
    """torch.optim's constructor checks, with its messages, for the hyperparameters in ``defaults``.

    ValueError for lr < 0, eps < 0, a beta outside [0, 1), weight_decay < 0, momentum < 0,
    max_grad_norm < 0 and any NaN (the comparisons are written so that NaN fails them); TypeError
    for betas that are not a pair, a tensor lr of more than one element, and a tuple passed
    positionally into ``bias_correction`` (Apex's argument order differs from torch's).
    """
    bias_correction = defaults.get("bias_correction", True)
    if isinstance(bias_correction, (tuple, list)) or torch.is_tensor(bias_correction):
        order = "bias_correction, "
        raise TypeError(
            APEX_ORDER.format(
                owner=owner, arg="bias_correction", value=bias_correction, order=order
            )
        )
    if "lr" in defaults:
        lr = defaults["lr"]
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        value = _value(lr)
        if not isinstance(value, numbers.Real) and not torch.is_tensor(value):
            raise TypeError(f"{owner}: lr must be a number or a 1-element tensor, got {lr!r}")
        if isinstance(value, numbers.Real) and not 0.0 <= value:
            raise ValueError(f"Invalid learning rate: {value}")
    if "eps" in defaults and not 0.0 <= _value(defaults["eps"]):
        raise ValueError(f"Invalid epsilon value: {defaults['eps']}")
    if "betas" in defaults:
        betas = defaults["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            if not 0.0 <= _value(beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {_value(beta)}")
    for name in ("weight_decay", "momentum", "max_grad_norm"):
        if name in defaults and not 0.0 <= _value(defaults[name]):
            raise ValueError(f"Invalid {name} value: {defaults[name]}")
    for name, value in defaults.items():  # e.g. dampening: torch does not check it, NaN is no value
        value = _value(value)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"Invalid {name} value: {value}")
    if defaults.get("nesterov") and (
        defaults.get("momentum", 0) <= 0 or defaults.get("dampening", 0) != 0
    ):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def check_torch_flags(
    owner: str,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
    maximize_supported: bool = True,
) -> None:
    """torch.optim's common keyword arguments.

    ``foreach`` and ``fused`` are accepted and ignored (the kernels are always fused multi-tensor
    kernels); ``differentiable=True`` is rejected (the kernels update in place, outside autograd);
    ``maximize=True`` is rejected where the class does not implement it.
    """
    del foreach, fused  # no-ops: there is only the fused path
    if differentiable:
        raise NotImplementedError(
            f"{owner} does not support differentiable=True: its fused kernels update the params "
            "in place outside autograd; use a torch.optim optimizer with differentiable=True to "
            "differentiate through the step"
        )
    if maximize and not maximize_supported:
        raise NotImplementedError(
            f"{owner} does not support maximize=True (neither does Apex's); minimize the negated "
            "objective instead"
        )
