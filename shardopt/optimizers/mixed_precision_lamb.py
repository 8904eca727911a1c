"""``FusedMixedPrecisionLamb`` (drop-in for apex.optimizers.FusedMixedPrecisionLamb).

LAMB whose lr and step live on the device (no host sync in ``step``), with fp32 masters and fp32
state for params of ``reduced_precision_dtype``, created at the first step; loss-scaled grads are
unscaled inside the kernels and a found inf/nan skips the step without advancing it.
"""

from __future__ import annotations

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
        params: iterable of params or of param-group dicts (one dtype per group).
        lr: learning rate (stored as a device tensor).
        step: initial step count (stored as a device tensor).
        bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, grad_averaging,
        max_grad_norm, use_nvlamb: as ``FusedLAMB``.
        reduced_precision_dtype: fp16 or bf16; params of this dtype get fp32 masters and state.

    Raises:
        RuntimeError: a group mixing dtypes; ``amsgrad=True``; sparse grads.

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
    ) -> None:
        if reduced_precision_dtype not in (None, *LOW_PRECISION):
            raise ValueError(
                f"reduced_precision_dtype must be torch.float16, torch.bfloat16 or None, got "
                f"{reduced_precision_dtype}"
            )
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
        )
        self.reduced_precision_dtype = reduced_precision_dtype
        for i, group in enumerate(self.param_groups):
            dtypes = {p.dtype for p in group["params"]}
            if len(dtypes) > 1:
                names = ", ".join(sorted(str(d) for d in dtypes))
                raise RuntimeError(
                    f"FusedMixedPrecisionLamb: all params of a group must share one dtype; group "
                    f"{i} has {names}"
                )
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            group["lr"] = torch.tensor(
                float(lr if not torch.is_tensor(group["lr"]) else group["lr"]),
                dtype=torch.float32,
                device=device,
            )
            group["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)

    def _masters(self, params: list) -> tuple[list, list | None]:
        if self.reduced_precision_dtype is None or params[0].dtype != self.reduced_precision_dtype:
            return params, None
        return super()._masters(params)
