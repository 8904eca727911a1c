"""``FusedMixedPrecisionLamb`` (drop-in for apex.optimizers.FusedMixedPrecisionLamb).

LAMB whose lr and step live on the device (no host sync in ``step``), with fp32 masters and fp32
state for params of ``reduced_precision_dtype``, created at the first step; loss-scaled grads are
unscaled inside the kernels and a found inf/nan skips the step without advancing it. Its
definition is shardopt/algorithms/mixed_precision_lamb.py (LAMB's, plus ``step`` and
``reduced_precision_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt.algorithms import mixed_precision_lamb
from shardopt.optimizers.lamb import FusedLAMB

H = mixed_precision_lamb.Hyperparams  # the defaults below are the algorithm's


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
        lr: float = H.lr,
        step: int = H.step,
        bias_correction: bool = H.bias_correction,
        betas: tuple[float, float] = H.betas,
        eps: float = H.eps,
        weight_decay: float = H.weight_decay,
        amsgrad: bool = H.amsgrad,
        adam_w_mode: bool = H.adam_w_mode,
        grad_averaging: bool = H.grad_averaging,
        max_grad_norm: float = H.max_grad_norm,
        use_nvlamb: bool = H.use_nvlamb,
        reduced_precision_dtype: torch.dtype | None = H.reduced_precision_dtype,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = mixed_precision_lamb.Hyperparams(
            lr=lr,
            step=step,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            reduced_precision_dtype=reduced_precision_dtype,
        )
        self._initial_step = step  # read by add_param_group, after the checks
        self._construct(
            params,
            hyper,
            set_grad_none=True,
            capturable=True,
            master_weights=reduced_precision_dtype is not None,
            flags=dict(
                maximize=maximize, foreach=foreach, fused=fused, differentiable=differentiable
            ),
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
        step = float(self._initial_step) if constructing else 0.0
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
