"""``FusedMixedPrecisionLamb`` (drop-in for apex.optimizers.FusedMixedPrecisionLamb).

LAMB whose lr and step live on the device (no host sync in ``step``), with fp32 masters and fp32
state for params of ``reduced_precision_dtype``, created at the first step; loss-scaled grads are
unscaled inside the kernels and a found inf/nan skips the step without advancing it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from shardopt.optimizers.fused_optimizer import LOW_PRECISION
from shardopt.optimizers.lamb import FusedLAMB


class FusedMixedPrecisionLamb(FusedLAMB):
    """LAMB for mixed-precision training with device-resident lr and step.

    Works with ``torch.amp.GradScaler``: the scaler hands its scale and found-inf flag to the
    optimizer, the global norm is taken on the scaled grads and compared with
    ``max_grad_norm * scale``, and an overflow skips the step on the device.

    Args:
        params: iterable of params or of param-group dicts; a group may mix dtypes (params of
            ``reduced_precision_dtype`` get masters, the others are updated directly).
        lr: learning rate (stored as a device tensor).
        step: initial step count (stored as a device tensor).
        bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, grad_averaging,
        max_grad_norm, use_nvlamb: as ``FusedLAMB``.
        reduced_precision_dtype: fp16 or bf16; params of this dtype get fp32 masters and state.
        foreach, fused, maximize, differentiable: as ``FusedLAMB``.

    Each group's lr (a per-group float, or the constructor's) becomes a device tensor, also for
    groups added later by ``add_param_group``.

    Raises:
        RuntimeError: ``amsgrad=True``; sparse grads.
        TypeError: a tuple passed positionally into ``step`` (torch's argument order instead of
            Apex's).
        ValueError: as ``FusedLAMB``.

    Example:
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> bf16 = torch.bfloat16
        >>> opt = FusedMixedPrecisionLamb(model.parameters(), reduced_precision_dtype=bf16)
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).sum().backward(); opt.step()
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        if reduced_precision_dtype not in (None, *LOW_PRECISION):
            raise ValueError(
                f"reduced_precision_dtype must be torch.float16, torch.bfloat16 or None, got "
                f"{reduced_precision_dtype}"
            )
        if not isinstance(step, numbers.Real) and not torch.is_tensor(step):
            raise TypeError(
                f"FusedMixedPrecisionLamb: step got {step!r}, which looks like betas. Apex's "
                "positional order is FusedMixedPrecisionLamb(params, lr, step, bias_correction, "
                "betas, eps, ...), unlike torch.optim.Adam(params, lr, betas, eps, ...); pass "
                "betas=... (and the other hyperparameters) by keyword"
            )
        self._initial_step = float(step)
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            capturable=True,
            master_weights=reduced_precision_dtype is not None,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        self.reduced_precision_dtype = reduced_precision_dtype

    def add_param_group(self, param_group: dict) -> None:
        """As ``FusedOptimizer.add_param_group``; the group's lr (its own, else the constructor's)
        and step (the constructor's ``step`` during construction, 0 after) become fp32 tensors on
        the group's device. A group may mix dtypes, as Apex's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        lr = group["lr"]
        if torch.is_tensor(lr):  # Apex's rule: a tensor lr is kept (moved to the device)
            group["lr"] = lr.to(device=device, dtype=torch.float32)
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        constructing = not hasattr(self, "reduced_precision_dtype")
        step = self._initial_step if constructing else 0.0
        group["step"] = torch.tensor(step, dtype=torch.float32, device=device)

    def _after_load(self) -> None:
        # lr stays a device tensor (a loaded float lr lands in a copy of the group's tensor)
        for group in self.param_groups:
            device = group["params"][0].device
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)

    def _keeps_master(self, p: torch.Tensor) -> bool:
        return p.dtype == self.reduced_precision_dtype

    def _plan_key(self, group: dict) -> tuple:
        return self.master_weights, self.reduced_precision_dtype
