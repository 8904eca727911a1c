"""The five ZeRO-sharded optimizers: thin classes that plug an algorithm into the engine.

Each takes its algorithm's hyperparameters and defaults (shardopt/algorithms/, the definitions the
single-process classes take too) plus the keyword-only sharding arguments of
``DistributedOptimizer`` (``ZERO_ARGS_DOC`` in shardopt/zero/settings.py), and calls the
algorithm's update on this rank's flat shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import adagrad, adam, lamb, novograd, sgd
from shardopt.algorithms.hyperparams import Hyperparams
from shardopt.algorithms.validation import check_torch_flags
from shardopt.zero import comm, state_storage
from shardopt.zero.amp import StepScalars
from shardopt.zero.apex.compat import APEX_DEFAULTS
from shardopt.zero.engine import DistributedOptimizer
from shardopt.zero.settings import show_sharding_args
from shardopt.zero.update_calls import sum_by_param

_TORCH_FLAGS = ("maximize", "foreach", "fused", "differentiable")


def amp_args(buf: Any, scalars: StepScalars) -> dict[str, torch.Tensor | None]:
    """The step's grad scale (averaging x inverse loss scale x clip coefficient) and overflow
    flag where ``buf``'s update runs (on the host for an offloaded key)."""
    return {
        "grad_scale_t": DistributedOptimizer._to_update(buf, scalars.grad_scale_t),
        "found_inf_t": DistributedOptimizer._to_update(buf, scalars.found_inf_t),
    }


def group_defaults(owner: str, hyper: Hyperparams, zero_args: dict) -> dict[str, Any]:
    """The param-group defaults of ``hyper`` after the single-process classes' checks, in their
    order: torch.optim's common flags (taken out of ``zero_args``, the engine's keyword arguments;
    no ZeRO class implements ``maximize``), then the algorithm's."""
    flags = {k: zero_args.pop(k) for k in _TORCH_FLAGS if k in zero_args}
    check_torch_flags(owner, maximize_supported=False, **flags)
    hyper.validate(owner)
    return hyper.group_defaults()


class DistributedFusedAdam(DistributedOptimizer):
    """ZeRO-sharded Adam/AdamW: ``FusedAdam``'s algorithm on this rank's shard.

    Args:
        params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad: as
            ``FusedAdam`` (shardopt/algorithms/adam.py).
        **zero_args: the sharding arguments below.

    Example:
        >>> opt = DistributedFusedAdam(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> loss_fn(model(x)).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    state_names = adam.STATE_NAMES
    state_signed = adam.STATE_SIGNED
    compact_storage = True
    bucketwise_update = True

    def __init__(
        self,
        params: Iterable,
        lr: float = adam.Hyperparams.lr,
        bias_correction: bool = adam.Hyperparams.bias_correction,
        betas: tuple[float, float] = adam.Hyperparams.betas,
        eps: float = adam.Hyperparams.eps,
        adam_w_mode: bool = adam.Hyperparams.adam_w_mode,
        weight_decay: float = adam.Hyperparams.weight_decay,
        amsgrad: bool = adam.Hyperparams.amsgrad,
        **zero_args,
    ) -> None:
        hyper = adam.Hyperparams(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        super().__init__(params, group_defaults(type(self).__name__, hyper, zero_args), **zero_args)

    def _update(self, scalars: StepScalars) -> None:
        for group, buf, call in self._each_call():
            if state_storage.needs_codec(buf):
                self._update_compact(group, buf, call, scalars)
                continue
            adam.update(
                group,
                call.of(self._grads(buf)),
                call.of(buf.master),
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                call.outs(),
                step=call.step_t(group),
                lr=group["lr"],
                **amp_args(buf, scalars),
            )

    def _update_compact(self, group: dict, buf, call, scalars: StepScalars) -> None:
        """One kernel call over compact storage (see Note: compact storage in
        state_storage.py) with Adam's scalar arguments; a separate fp32 master's low-precision
        copy is written after it."""
        masters = call.of(buf.master)
        scales = [call.blocks_of(buf.scales[n]) if buf.scales else [] for n in self.state_names]
        kernels.adam_compact(
            [
                call.of(self._grads(buf)),
                masters,
                call.of(buf.remainder) if buf.remainder is not None else [],
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                *scales,
            ],
            state_format=buf.storage.state_format,
            **adam.kernel_args(
                group, step=call.step_t(group), lr=group["lr"], device=buf.update_device
            ),
            **amp_args(buf, scalars),
        )
        outs = call.outs()
        if outs is not None and buf.master_kind == "copy":
            for out, master in zip(outs, masters):
                out.copy_(master)


class DistributedFusedSGD(DistributedOptimizer):
    """ZeRO-sharded SGD with momentum: ``FusedSGD``'s algorithm on this rank's shard.

    Whether the momentum buffers were initialised (torch's first-step rule: buffer = grad) is a
    device flag, so a first step skipped by a GradScaler needs no host sync either.
    """

    bucketwise_update = True
    #: written once per step by ``_update``: CPU offload's per-bucket updates each start from
    #: the values before the step (offload_worker.frozen_view)
    per_step_attributes = ("_momentum_started",)

    state_names = sgd.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = sgd.Hyperparams.lr,
        momentum: float = sgd.Hyperparams.momentum,
        dampening: float = sgd.Hyperparams.dampening,
        weight_decay: float = sgd.Hyperparams.weight_decay,
        nesterov: bool = sgd.Hyperparams.nesterov,
        wd_after_momentum: bool = sgd.Hyperparams.wd_after_momentum,
        **zero_args,
    ) -> None:
        hyper = sgd.Hyperparams(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )
        super().__init__(params, group_defaults(type(self).__name__, hyper, zero_args), **zero_args)
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
                sgd.update(
                    group,
                    call.of(self._grads(buf)),
                    call.of(buf.master),
                    call.of(buf.state["momentum_buffer"]),
                    call.outs(),
                    first_run=False,
                    first_run_t=self._to_update(buf, first),
                    lr=group["lr"],
                    **amp_args(buf, scalars),
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
    """ZeRO-sharded Adagrad: ``FusedAdagrad``'s algorithm on this rank's shard."""

    state_names = adagrad.STATE_NAMES
    bucketwise_update = True

    def __init__(
        self,
        params: Iterable,
        lr: float = adagrad.Hyperparams.lr,
        eps: float = adagrad.Hyperparams.eps,
        weight_decay: float = adagrad.Hyperparams.weight_decay,
        adagrad_w_mode: bool = adagrad.Hyperparams.adagrad_w_mode,
        **zero_args,
    ) -> None:
        hyper = adagrad.Hyperparams(
            lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode
        )
        super().__init__(params, group_defaults(type(self).__name__, hyper, zero_args), **zero_args)

    def _update(self, scalars: StepScalars) -> None:
        for group, buf, call in self._each_call():
            adagrad.update(
                group,
                call.of(self._grads(buf)),
                call.of(buf.master),
                call.of(buf.state["sum"]),
                call.outs(),
                lr=group["lr"],
                **amp_args(buf, scalars),
            )


class DistributedFusedLAMB(DistributedOptimizer):
    """ZeRO-sharded LAMB: ``FusedLAMB``'s algorithm on this rank's shard.

    The global grad norm is one all-reduced sum of squares (skipped when ``max_grad_norm=0``),
    from which stage 1 computes the clip factor, as ``FusedLAMB``'s does; the per-tensor ||w||
    and ||u|| are per-fragment partial sums, returned by stage 1, added per param
    (``index_add``) and all-reduced as one vector of length 2 x #params between stage 1 and
    stage 2, which recomputes u from the stored moments.
    """

    state_names = lamb.STATE_NAMES
    needs_grad_norm = True

    def __init__(
        self,
        params: Iterable,
        lr: float = lamb.Hyperparams.lr,
        bias_correction: bool = lamb.Hyperparams.bias_correction,
        betas: tuple[float, float] = lamb.Hyperparams.betas,
        eps: float = lamb.Hyperparams.eps,
        weight_decay: float = lamb.Hyperparams.weight_decay,
        amsgrad: bool = lamb.Hyperparams.amsgrad,
        adam_w_mode: bool = lamb.Hyperparams.adam_w_mode,
        grad_averaging: bool = lamb.Hyperparams.grad_averaging,
        max_grad_norm: float = lamb.Hyperparams.max_grad_norm,
        use_nvlamb: bool = lamb.Hyperparams.use_nvlamb,
        **zero_args,
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
        super().__init__(params, group_defaults(type(self).__name__, hyper, zero_args), **zero_args)
        # the global grad norm is only needed to clip (max_grad_norm=0: no clipping, no norm pass)
        self.needs_grad_norm = lamb.clips(max_grad_norm)

    def _update(self, scalars: StepScalars) -> None:
        max_grad_norm = self.defaults["max_grad_norm"]
        # the sum of squares of the grads as stage 1 reads them (summed, not yet scaled)
        grad_norm_sq_t = scalars.sumsq if lamb.clips(max_grad_norm) else None
        n = len(self.params)
        sums = torch.zeros(2 * n, dtype=torch.float32, device=self.device)
        index, w_parts, u_parts = [], [], []
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
                w_sq, u_sq = lamb.stage1(
                    group,
                    call.of(self._grads(buf)),
                    masters,
                    exp_avg,
                    exp_avg_sq,
                    step=step_t,
                    grad_norm_sq_t=self._to_update(buf, grad_norm_sq_t),
                    max_grad_norm=max_grad_norm,
                    **amp_args(buf, scalars),
                    # an offloaded key's CPU sums with the bits of the CUDA kernel's
                    cuda_order=buf.offloaded and self.device.type == "cuda",
                )
                index.append(call.index)
                w_parts.append(w_sq.to(self.device, torch.float32))
                u_parts.append(u_sq.to(self.device, torch.float32))
                staged.append((call, group, buf, masters, exp_avg, exp_avg_sq, step_t))
        sum_by_param(sums[:n], index, w_parts)  # in a fixed order (also on CUDA)
        sum_by_param(sums[n:], index, u_parts)
        comm.all_reduce(sums, self.process_group)
        for call, group, buf, masters, exp_avg, exp_avg_sq, step_t in staged:
            lamb.stage2(
                group,
                masters,
                exp_avg,
                exp_avg_sq,
                call.outs(),
                self._to_update(buf, sums[:n].index_select(0, call.index)),
                self._to_update(buf, sums[n:].index_select(0, call.index)),
                step=step_t,
                lr=group["lr"],
                found_inf_t=self._to_update(buf, scalars.found_inf_t),
            )


class DistributedFusedNovoGrad(DistributedOptimizer):
    """ZeRO-sharded NovoGrad: ``FusedNovoGrad``'s algorithm on this rank's shard.

    Per-tensor grad norms are per-fragment partial sums of squares (or maxima for norm_type 0)
    combined per param and all-reduced (sum, or max) before the blend of the second moments
    (``novograd.blend_second_moment``) and the update.
    """

    state_names = novograd.STATE_NAMES

    def __init__(
        self,
        params: Iterable,
        lr: float = novograd.Hyperparams.lr,
        bias_correction: bool = novograd.Hyperparams.bias_correction,
        betas: tuple[float, float] = novograd.Hyperparams.betas,
        eps: float = novograd.Hyperparams.eps,
        weight_decay: float = novograd.Hyperparams.weight_decay,
        amsgrad: bool = novograd.Hyperparams.amsgrad,
        reg_inside_moment: bool = novograd.Hyperparams.reg_inside_moment,
        grad_averaging: bool = novograd.Hyperparams.grad_averaging,
        norm_type: int = novograd.Hyperparams.norm_type,
        init_zero: bool = novograd.Hyperparams.init_zero,
        **zero_args,
    ) -> None:
        hyper = novograd.Hyperparams(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            grad_averaging=grad_averaging,
            reg_inside_moment=reg_inside_moment,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(params, group_defaults(type(self).__name__, hyper, zero_args), **zero_args)
        # one entry per trainable param, in the dtype of the math: the masters, which are fp32
        # (also for fp64 params) or the 16-bit params themselves under a 16-bit ``dtype``
        dtype = novograd.second_moment_dtype(key.buffers.master.dtype for key in self.keys)
        # (by engine param: the same index space whatever the keys, also after a re-plan)
        self.second_moment = torch.zeros(len(self.params), dtype=dtype, device=self.device)

    def _update(self, scalars: StepScalars) -> None:
        n = len(self.params)
        sums = torch.zeros(n, dtype=torch.float32, device=self.device)
        maxes = torch.zeros(n, dtype=torch.float32, device=self.device)
        calls = {key.index: self._calls(key, per_tensor=True) for key in self.keys}
        index, parts = [], []
        for key in self.keys:
            group, buf = self.param_groups[key.group_index], key.buffers
            inf_norm = group["norm_type"] == 0
            for call in calls[key.index]:
                if not call.shard_ranges:
                    continue
                _, per = kernels.norm(call.of(buf.grad_shard), max_norm=inf_norm)  # on the device
                per = per.to(self.device, torch.float32)
                if inf_norm:
                    maxes.scatter_reduce_(0, call.index, per, reduce="amax")
                else:
                    index.append(call.index)
                    parts.append(per)
        sum_by_param(sums, index, parts)  # in a fixed order (also on CUDA)
        comm.all_reduce(sums, self.process_group)
        comm.all_reduce(maxes, self.process_group, op="max")
        scale = scalars.grad_scale_t.abs()
        # see Note: skipped params: a param's own step, and no change for a skipped one
        offsets = self.update_calls.step_offsets()
        unused = self.update_calls.unused
        for key in self.keys:
            group, buf = self.param_groups[key.group_index], key.buffers
            members = self._member_index(key)
            raw = maxes if group["norm_type"] == 0 else sums
            norms = novograd.grad_norms(group["norm_type"], raw).index_select(0, members) * scale
            old = self.second_moment.index_select(0, members)
            own_step = group["step"].reshape(1)
            if offsets is not None:
                own_step = own_step - offsets.index_select(0, members)
            fresh = (own_step == 1).expand_as(norms)
            new = novograd.blend_second_moment(
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
                # (the mask is the plan's: a re-plan's keys hold other params)
                new = torch.where(self.update_calls.used_mask(key), new, old)
            self.second_moment.index_copy_(0, members, new)
            for call in calls[key.index]:
                if not call.shard_ranges:
                    continue
                novograd.update(
                    group,
                    call.of(self._grads(buf)),
                    call.of(buf.master),
                    call.of(buf.state["exp_avg"]),
                    call.outs(),
                    self._to_update(buf, self.second_moment.index_select(0, call.index)),
                    step=call.step_t(group),
                    lr=group["lr"],
                    **amp_args(buf, scalars),
                )

    def _group_indices(self, group_index: int) -> tuple[list[int], list[int]]:
        """(positions in the group, engine param indices) of the group's trainable params."""
        positions, indices = [], []
        for j, p in enumerate(self.param_groups[group_index]["params"]):
            i = self.sharded.param_index.get(id(p))
            if i is not None:
                positions.append(j)
                indices.append(i)
        return positions, indices

    def _extra_group_state(self, group_index: int) -> dict:
        positions, indices = self._group_indices(group_index)
        vec = torch.zeros(len(self.param_groups[group_index]["params"]), dtype=torch.float32)
        if indices:  # one gather and one device-to-host copy
            index = torch.tensor(indices, dtype=torch.long, device=self.device)
            values = self.second_moment.index_select(0, index).to("cpu", torch.float32)
            vec[torch.tensor(positions, dtype=torch.long)] = values
        return {"exp_avg_sq": vec}

    def _load_extra_group_state(self, group_index: int, saved_group: dict) -> None:
        vec = saved_group.get("exp_avg_sq")
        if vec is None:
            return
        vec = torch.as_tensor(vec, dtype=torch.float32)  # a list when read from JSON
        positions, indices = self._group_indices(group_index)
        if indices:  # one host-to-device copy and one scatter
            values = vec[torch.tensor(positions, dtype=torch.long)].to(self.device)
            index = torch.tensor(indices, dtype=torch.long, device=self.device)
            self.second_moment.index_copy_(0, index, values.to(self.second_moment.dtype))


for _cls in (
    DistributedFusedAdam,
    DistributedFusedSGD,
    DistributedFusedAdagrad,
    DistributedFusedLAMB,
    DistributedFusedNovoGrad,
):
    show_sharding_args(_cls, DistributedOptimizer.__init__, APEX_DEFAULTS)
