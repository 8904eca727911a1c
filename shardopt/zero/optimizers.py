"""The five ZeRO-sharded optimizers: thin classes that plug an update rule into the engine.

Each takes the single-process class's hyperparameters and defaults, plus the keyword-only sharding
arguments of ``DistributedOptimizer`` (``ZERO_ARGS_DOC`` in shardopt/zero/settings.py), and calls
the same update functions as the single-process class on this rank's flat shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardopt.optimizers.adagrad import adagrad_apply
from shardopt.optimizers.adam import adam_apply
from shardopt.optimizers.fused_optimizer import (
    check_hyperparams,
    check_torch_flags,
    reject_amsgrad,
)
from shardopt.optimizers.lamb import clip_scale, lamb_stage1_apply, lamb_stage2_apply
from shardopt.optimizers.novograd import blend_second_moment, check_norm_type
from shardopt.optimizers.sgd import _REQUIRED, check_sgd_lr, sgd_apply
from shardopt.zero import comm, state_storage
from shardopt.zero.amp import StepScalars
from shardopt.zero.engine import DistributedOptimizer

_TORCH_FLAGS = ("maximize", "foreach", "fused", "differentiable")


def _check_args(owner: str, defaults: dict, zero_args: dict) -> None:
    """The single-process classes' argument checks; takes torch.optim's common flags out of
    ``zero_args`` (the engine's keyword arguments)."""
    flags = {k: zero_args.pop(k) for k in _TORCH_FLAGS if k in zero_args}
    check_torch_flags(owner, maximize_supported=False, **flags)
    check_hyperparams(defaults, owner)


class DistributedFusedAdam(DistributedOptimizer):
    """ZeRO-sharded Adam/AdamW: ``FusedAdam``'s math on this rank's shard.

    Args:
        params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad: as
            ``FusedAdam``.
        **zero_args: see the module's sharding arguments.

    Example:
        >>> opt = DistributedFusedAdam(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> loss_fn(model(x)).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    state_names = ("exp_avg", "exp_avg_sq")
    state_signed = {"exp_avg": True, "exp_avg_sq": False}
    compact_storage = True
    bucketwise_update = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        **zero_args,
    ) -> None:
        reject_amsgrad(amsgrad, type(self).__name__)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )
        _check_args(type(self).__name__, defaults, zero_args)
        super().__init__(params, defaults, **zero_args)

    def _update(self, scalars: StepScalars) -> None:
        for group, buf, call in self._each_call():
            if state_storage.needs_codec(buf):
                self._update_compact(group, buf, call, scalars)
                continue
            adam_apply(
                group,
                call.of(self._grads(buf)),
                call.of(buf.master),
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                call.outs(),
                step=0,
                **self._lr(group, buf),
                **self._kernel_scalars(group, call, scalars),
            )

    def _update_compact(self, group: dict, buf, call, scalars: StepScalars) -> None:
        """One kernel call over compact storage (see Note: compact storage in
        state_storage.py); a separate fp32 master's low-precision copy is written after it."""
        from shardopt.kernels import compact as _compact_ops

        masters = call.of(buf.master)
        scales = [call.blocks_of(buf.scales[n]) if buf.scales else [] for n in self.state_names]
        beta1, beta2 = group["betas"]
        _compact_ops.adam_compact(
            [
                call.of(self._grads(buf)),
                masters,
                call.of(buf.remainder) if buf.remainder is not None else [],
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                *scales,
            ],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=0,
            adam_w_mode=group["adam_w_mode"],
            bias_correction=group["bias_correction"],
            weight_decay=group["weight_decay"],
            state_format=buf.storage.state_format,
            **self._lr(group, buf),
            **self._kernel_scalars(group, call, scalars),
        )
        outs = call.outs()
        if outs is not None and buf.master_kind == "copy":
            for out, master in zip(outs, masters):
                out.copy_(master)


class DistributedFusedSGD(DistributedOptimizer):
    """ZeRO-sharded SGD with momentum: ``FusedSGD``'s math on this rank's shard.

    Whether the momentum buffers were initialised (torch's first-step rule: buffer = grad) is a
    device flag, so a first step skipped by a GradScaler needs no host sync either.
    """

    bucketwise_update = True
    #: written once per step by ``_update``: CPU offload's per-bucket updates each start from
    #: the values before the step (offload_worker.frozen_view)
    per_step_attributes = ("_momentum_started",)

    state_names = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable,
        lr: float = _REQUIRED,  # type: ignore[assignment]
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        **zero_args,
    ) -> None:
        check_sgd_lr(lr, type(self).__name__)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )
        _check_args(type(self).__name__, defaults, zero_args)
        super().__init__(params, defaults, **zero_args)
        #: per group, 1 once the momentum buffers hold a momentum (a device flag: the first step
        #: may be skipped by a GradScaler, and reading that on the host would sync)
        self._momentum_started = [
            torch.zeros(1, dtype=torch.float32, device=self.device) for _ in self.param_groups
        ]

    def _update(self, scalars: StepScalars) -> None:
        first_run = [1 - started for started in self._momentum_started]  # before any update
        for key in self.keys:
            gi = key.group_index
            group, buf = self.param_groups[gi], key.buffers
            for call in self._calls(key):
                # params that skipped steps start their momentum at their own first update
                first = (call.step_t(group) <= 1).float() if call.offset else first_run[gi]
                sgd_apply(
                    group,
                    call.of(self._grads(buf)),
                    call.of(buf.master),
                    call.of(buf.state["momentum_buffer"]),
                    call.outs(),
                    first_run=False,
                    first_run_t=self._to_update(buf, first),
                    **self._lr(group, buf),
                    grad_scale_t=self._to_update(buf, scalars.grad_scale_t),
                    found_inf_t=self._to_update(buf, scalars.found_inf_t),
                )
        for started in self._momentum_started:
            if scalars.found_inf_t is None:
                started.fill_(1.0)
            else:  # a skipped step starts nothing
                torch.maximum(started, 1 - scalars.found_inf_t, out=started)

    def _extra_group_state(self, group_index: int) -> dict:
        return {"momentum_started": bool(self._momentum_started[group_index].item())}

    def _load_extra_group_state(self, group_index: int, saved_group: dict) -> None:
        started = saved_group.get("momentum_started", float(saved_group.get("step", 0)) > 0)
        self._momentum_started[group_index].fill_(float(bool(started)))


class DistributedFusedAdagrad(DistributedOptimizer):
    """ZeRO-sharded Adagrad: ``FusedAdagrad``'s math on this rank's shard."""

    state_names = ("sum",)
    bucketwise_update = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        adagrad_w_mode: bool = False,
        **zero_args,
    ) -> None:
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode)
        _check_args(type(self).__name__, defaults, zero_args)
        super().__init__(params, defaults, **zero_args)

    def _update(self, scalars: StepScalars) -> None:
        for group, buf, call in self._each_call():
            adagrad_apply(
                group,
                call.of(self._grads(buf)),
                call.of(buf.master),
                call.of(buf.state["sum"]),
                call.outs(),
                **self._lr(group, buf),
                grad_scale_t=self._to_update(buf, scalars.grad_scale_t),
                found_inf_t=self._to_update(buf, scalars.found_inf_t),
            )


class DistributedFusedLAMB(DistributedOptimizer):
    """ZeRO-sharded LAMB: ``FusedLAMB``'s math on this rank's shard.

    The global grad norm is one all-reduced sum of squares (skipped when ``max_grad_norm=0``);
    the per-tensor ||w|| and ||u|| are per-fragment partial sums, returned by stage 1, added per
    param (``index_add``) and all-reduced as one vector of length 2 x #params between stage 1 and
    stage 2, which recomputes u from the stored moments.
    """

    state_names = ("exp_avg", "exp_avg_sq")
    needs_grad_norm = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        **zero_args,
    ) -> None:
        reject_amsgrad(amsgrad, type(self).__name__)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )
        _check_args(type(self).__name__, defaults, zero_args)
        super().__init__(params, defaults, **zero_args)
        # the global grad norm is only needed to clip (max_grad_norm=0: no clipping, no norm pass)
        self.needs_grad_norm = max_grad_norm > 0

    def _update(self, scalars: StepScalars) -> None:
        grad_scale_t = scalars.grad_scale_t
        max_grad_norm = self.defaults["max_grad_norm"]
        if max_grad_norm > 0:
            norm = scalars.sumsq.sqrt() * grad_scale_t
            grad_scale_t = grad_scale_t * clip_scale(norm, max_grad_norm)
        n = len(self.params)
        sums = torch.zeros(2 * n, dtype=torch.float32, device=self.device)
        staged = []
        for key in self.keys:
            group, buf = self.param_groups[key.group_index], key.buffers
            for call in self._calls(key, per_tensor=True):
                if not call.shard_ranges:
                    continue
                masters = call.of(buf.master)
                exp_avg = call.of(buf.state["exp_avg"])
                exp_avg_sq = call.of(buf.state["exp_avg_sq"])
                step_t = call.step_t(group)
                w_sq, u_sq = lamb_stage1_apply(
                    group,
                    call.of(self._grads(buf)),
                    masters,
                    exp_avg,
                    exp_avg_sq,
                    step=0,
                    grad_scale_t=self._to_update(buf, grad_scale_t),
                    step_t=step_t,
                    found_inf_t=self._to_update(buf, scalars.found_inf_t),
                )
                sums[:n].index_add_(0, call.index, w_sq.to(self.device, torch.float32))
                sums[n:].index_add_(0, call.index, u_sq.to(self.device, torch.float32))
                staged.append((call, group, buf, masters, exp_avg, exp_avg_sq, step_t))
        comm.all_reduce(sums, self.process_group)
        for call, group, buf, masters, exp_avg, exp_avg_sq, step_t in staged:
            lamb_stage2_apply(
                group,
                masters,
                exp_avg,
                exp_avg_sq,
                call.outs(),
                self._to_update(buf, sums[:n].index_select(0, call.index)),
                self._to_update(buf, sums[n:].index_select(0, call.index)),
                **self._lr(group, buf),
                step=0,
                step_t=step_t,
                found_inf_t=self._to_update(buf, scalars.found_inf_t),
            )


class DistributedFusedNovoGrad(DistributedOptimizer):
    """ZeRO-sharded NovoGrad: ``FusedNovoGrad``'s math on this rank's shard.

    Per-tensor grad norms are per-fragment partial sums of squares (or maxima for norm_type 0)
    combined per param and all-reduced (sum, or max) before the update.
    """

    state_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        **zero_args,
    ) -> None:
        reject_amsgrad(amsgrad, type(self).__name__)
        check_norm_type(norm_type)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            reg_inside_moment=reg_inside_moment,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        _check_args(type(self).__name__, defaults, zero_args)
        super().__init__(params, defaults, **zero_args)
        self.second_moment = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)

    def _update(self, scalars: StepScalars) -> None:
        from shardopt import kernels as _ops
        from shardopt.optimizers.novograd import novograd_apply

        n = len(self.params)
        sums = torch.zeros(n, dtype=torch.float32, device=self.device)
        maxes = torch.zeros(n, dtype=torch.float32, device=self.device)
        calls = {key.index: self._calls(key, per_tensor=True) for key in self.keys}
        for key in self.keys:
            group, buf = self.param_groups[key.group_index], key.buffers
            inf_norm = group["norm_type"] == 0
            for call in calls[key.index]:
                if not call.shard_ranges:
                    continue
                _, per = _ops.norm(call.of(buf.grad_shard), max_norm=inf_norm)  # on the device
                per = per.to(self.device, torch.float32)
                if inf_norm:
                    maxes.scatter_reduce_(0, call.index, per, reduce="amax")
                else:
                    sums.index_add_(0, call.index, per)
        comm.all_reduce(sums, self.process_group)
        comm.all_reduce(maxes, self.process_group, op="max")
        scale = scalars.grad_scale_t.abs()
        # see Note: skipped params: a param's own step, and no change for a skipped one
        offsets = self.update_calls.step_offsets()
        unused = self.update_calls.unused
        for key in self.keys:
            group, buf = self.param_groups[key.group_index], key.buffers
            members = self._member_index(key)
            raw = maxes if group["norm_type"] == 0 else sums.sqrt()
            norms = raw.index_select(0, members) * scale
            old = self.second_moment.index_select(0, members)
            own_step = group["step"].reshape(1)
            if offsets is not None:
                own_step = own_step - offsets.index_select(0, members)
            fresh = (own_step == 1).expand_as(norms)
            new = blend_second_moment(
                old,
                norms,
                fresh,
                beta2=group["betas"][1],
                norm_type=group["norm_type"],
                init_zero=group["init_zero"],
            )
            if scalars.found_inf_t is not None:
                new = torch.where(scalars.found_inf_t.bool(), old, new)
            if unused:
                used = torch.tensor(
                    [i not in unused for i in key.layout.params], device=self.device
                )
                new = torch.where(used, new, old)
            self.second_moment.index_copy_(0, members, new)
            for call in calls[key.index]:
                if not call.shard_ranges:
                    continue
                novograd_apply(
                    group,
                    call.of(self._grads(buf)),
                    call.of(buf.master),
                    call.of(buf.state["exp_avg"]),
                    call.outs(),
                    self._to_update(buf, self.second_moment.index_select(0, call.index)),
                    step=0,
                    **self._lr(group, buf),
                    **self._kernel_scalars(group, call, scalars),
                )

    def _extra_group_state(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        vec = torch.zeros(len(group["params"]), dtype=torch.float32)
        for j, p in enumerate(group["params"]):
            i = self.sharded.param_index.get(id(p))
            if i is not None:
                vec[j] = self.second_moment[i].cpu()
        return {"exp_avg_sq": vec}

    def _load_extra_group_state(self, group_index: int, saved_group: dict) -> None:
        vec = saved_group.get("exp_avg_sq")
        if vec is None:
            return
        vec = torch.as_tensor(vec, dtype=torch.float32)  # a list when read from JSON
        group = self.param_groups[group_index]
        for j, p in enumerate(group["params"]):
            i = self.sharded.param_index.get(id(p))
            if i is not None:
                self.second_moment[i] = vec[j].to(self.device)
