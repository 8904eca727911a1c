"""``FusedLAMB`` (drop-in for apex.optimizers.FusedLAMB): LAMB on the single-process machinery.

The algorithm (hyperparameters, defaults, checks, the clipping rule, the two kernel stages) is
shardopt/algorithms/lamb.py, shared with ``DistributedFusedLAMB``; the math is
``csrc/optim/lamb_math.h``. With the grad-norm pass for clipping, a step reads and writes 44 bytes
per fp32 param (40 with ``max_grad_norm=0``). ``FusedLAMB`` hands stage 1 the grads' sum of
squares and lets the kernel compute the clip factor, so a step is three kernel calls and no tensor
op between them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardopt import kernels as _ops
from shardopt.algorithms import lamb
from shardopt.algorithms.hyperparams import Hyperparams
from shardopt.algorithms.validation import check_torch_flags
from shardopt.optimizers import dtensor
from shardopt.optimizers.fused_optimizer import FusedOptimizer

H = lamb.Hyperparams  # the defaults below are the algorithm's


class FusedLAMB(FusedOptimizer):
    """LAMB with fused multi-tensor kernels on CPU and CUDA tensors.

    A drop-in replacement for ``apex.optimizers.FusedLAMB``: the global grad norm over all groups
    clips the grads (``max_grad_norm``; 0 turns clipping off, where Apex's single-GPU kernel would
    zero every update), then each tensor's update is scaled by its trust ratio ``||w|| / ||u||``.
    Unlike Apex, state for fp16/bf16 params is kept in fp32. Do not clip grads again yourself.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: coefficients of the running averages.
        eps: added to the denominator after the square root.
        weight_decay: weight decay coefficient (decoupled when ``adam_w_mode``).
        amsgrad: not supported; True raises RuntimeError.
        adam_w_mode: decoupled weight decay (True) or L2 regularisation (False).
        grad_averaging: scale the grad by ``1 - beta1`` in the first moment.
        set_grad_none: default of ``zero_grad``'s ``set_to_none``.
        max_grad_norm: clip threshold of the global grad norm; 0 disables clipping.
        use_nvlamb: apply the trust ratio even to params with zero weight decay.
        capturable: keep lr and step on the device and take GradScaler's scale and found_inf
            without a host sync.
        master_weights: keep fp32 master copies of fp16/bf16 params.
        foreach, fused: accepted for torch.optim compatibility; no effect (always fused).
        maximize, differentiable: must be False (True raises NotImplementedError).

    Raises:
        RuntimeError: ``amsgrad=True``; sparse grads; params on several devices.
        TypeError: a param of an unsupported dtype; a tuple passed positionally into
            ``bias_correction`` (torch's argument order instead of Apex's).
        ValueError: lr, eps, weight_decay or max_grad_norm negative, a beta outside [0, 1), NaN.
        NotImplementedError: ``maximize=True`` or ``differentiable=True``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    state_names = lamb.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = H.lr,
        bias_correction: bool = H.bias_correction,
        betas: tuple[float, float] = H.betas,
        eps: float = H.eps,
        weight_decay: float = H.weight_decay,
        amsgrad: bool = H.amsgrad,
        adam_w_mode: bool = H.adam_w_mode,
        grad_averaging: bool = H.grad_averaging,
        set_grad_none: bool = True,
        max_grad_norm: float = H.max_grad_norm,
        use_nvlamb: bool = H.use_nvlamb,
        *,
        capturable: bool = False,
        master_weights: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        hyper = lamb.Hyperparams(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )
        self._construct(
            params,
            hyper,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
            flags=dict(
                maximize=maximize, foreach=foreach, fused=fused, differentiable=differentiable
            ),
        )

    def _construct(
        self,
        params: Iterable,
        hyper: Hyperparams,
        *,
        set_grad_none: bool,
        capturable: bool,
        master_weights: bool,
        flags: dict[str, Any],
    ) -> None:
        """The construction from ``hyper`` (LAMB's, or a variant's such as mixed-precision
        LAMB's) and torch.optim's common ``flags``."""
        check_torch_flags(type(self).__name__, maximize_supported=False, **flags)
        super().__init__(
            params,
            hyper,
            set_grad_none=set_grad_none,
            capturable=capturable,
            master_weights=master_weights,
        )
        # this step's sum of squares of all grads (for the clip factor stage 1 computes), set by
        # _before_step; a dict item, not an attribute: torch 2.11's Dynamo cannot trace a setattr
        # on the optimizer inside a compiled step
        self._step_tensors: dict[str, torch.Tensor] = {}

    def _before_step(self, work: list) -> None:
        if not work:
            return
        if len(work) > 1 and len({w.grads[0].device for w in work}) > 1:
            # the global grad norm spans every group
            all_params = [p for g in self.param_groups for p in g["params"]]
            _ops.check_param_devices(all_params, type(self).__name__)
        # max_grad_norm is read from the constructor defaults (Apex's behaviour); 0: no clipping,
        # and no pass over the grads for their norm
        if not lamb.clips(self.defaults["max_grad_norm"]):
            return
        grads = [g for w in work for g in w.grads]
        if all(w.plan is not None and w.plan.as_is for w in work):  # plain tensors
            total_sq, _ = _ops.norm(grads, as_is=True)
        elif dtensor.any_dtensor(grads):  # the norm of the full grads: shards' sums reduced
            _, per = _ops.norm(grads)
            total_sq = dtensor.reduce_per_tensor(per, grads).sum()
        else:
            total_sq, _ = _ops.norm(grads)
        self._step_tensors["grad_norm_sq_t"] = total_sq

    def _group_tensors(self, group: dict, params: list) -> tuple:
        math_params, outs = self._masters(params)
        exp_avg, exp_avg_sq = self._state_tensors(params)
        return math_params, outs, exp_avg, exp_avg_sq, dtensor.any_dtensor(math_params)

    def _apply(self, group: dict, grads: list, tensors: tuple, as_is: bool) -> None:
        math_params, outs, exp_avg, exp_avg_sq, sharded = tensors
        device = grads[0].device
        scalars = self._amp_scalars(device)
        grad_scale_t = scalars.pop("grad_scale_t", None)  # GradScaler's inverse scale
        found_inf_t = scalars.get("found_inf_t")
        max_grad_norm = self.defaults["max_grad_norm"]
        grad_norm_sq_t = self._step_tensors.get("grad_norm_sq_t")
        if grad_norm_sq_t is not None and grad_norm_sq_t.device != device:  # groups on devices
            grad_norm_sq_t = grad_norm_sq_t.to(device)
        step, lr = self._step_and_lr(group, device)
        w_sq, u_sq = lamb.stage1(
            group, grads, math_params, exp_avg, exp_avg_sq, step=step, grad_scale_t=grad_scale_t,
            grad_norm_sq_t=grad_norm_sq_t, max_grad_norm=max_grad_norm, found_inf_t=found_inf_t,
            as_is=as_is,
        )  # fmt: skip
        if sharded:  # ||w||, ||u|| of the full tensors
            n = len(math_params)
            both = dtensor.reduce_per_tensor(torch.cat([w_sq, u_sq]), list(math_params) * 2)
            w_sq, u_sq = both[:n], both[n:]
        lamb.stage2(
            group, math_params, exp_avg, exp_avg_sq, outs, w_sq, u_sq, step=step, lr=lr,
            found_inf_t=found_inf_t, as_is=as_is,
        )  # fmt: skip
