"""``DistributedFusedMuon``: Muon on the ZeRO engine, each matrix orthogonalized once, whole, by
the one rank whose shard holds it; AdamW, element-sharded, for the ``use_muon=False`` groups.

Note: whole matrices on one rank
    Muon's Newton-Schulz iteration needs each logical matrix whole. The Muon groups' keys are
    planned by ``WholeParamLayout`` (shardopt/zero/layout/whole_param.py): every param lies
    whole in one rank's chunk of one bucket (one fragment), ranks balanced by the param's
    Newton-Schulz FLOPs (``muon.ns_cost``); the AdamW groups keep ``ElementLayout``. So the grads
    are still reduce-scattered per bucket during backward and the params all-gathered per bucket
    after the step, and the step adds no collective: each rank runs the momentum, the Nesterov
    mix, Newton-Schulz (batched by shape over the params it owns), the decay and the apply on
    its own params, exactly ``FusedMuon``'s update (``muon_step`` in
    shardopt/optimizers/muon.py, the same function), on the reduced, averaged grad of the
    optimizer step (``no_sync()`` micro-batches are summed first), scaled by the step's grad
    scale (averaging x inverse loss scale x clip coefficient: clipping acts on the raw grads,
    before the momentum). The price is padding: every rank's chunk of a bucket is as long as the
    bucket's fullest (docs/muon.md, "Layout").

    HSDP replicas (``redundant_process_group``) hold the same shards: each replica runs the
    Newton-Schulz of its shard, as each runs the elementwise update of its shard in the other
    classes. Splitting it across replicas would need one more collective per step (the updated
    params of the other replicas' share); the work a rank repeats is 1/N of the model's (N the
    shard group's size).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from shardopt import kernels
from shardopt.algorithms import adam, muon
from shardopt.optimizers.muon import ADAMW_DEFAULTS, MUON_ONLY
from shardopt.optimizers.muon_step import drop_muon_steps, muon_step, shape_batches
from shardopt.optimizers.state_dict import COMMON_STATE_KEYS, check_state_keys
from shardopt.zero import comm, state_storage
from shardopt.zero.amp import StepScalars
from shardopt.zero.apex.compat import APEX_DEFAULTS
from shardopt.zero.engine import DistributedOptimizer
from shardopt.zero.layout import ElementLayout, Fragment, ShardLayout, WholeParamLayout
from shardopt.zero.optimizers import amp_args, group_defaults
from shardopt.zero.settings import show_sharding_args
from shardopt.zero.sharded_params import Key

H = muon.Hyperparams  # the defaults below are the algorithm's
#: the momentum's storage formats (plain casts: the buffer is the stored tensor itself)
MOMENTUM_FORMATS = ("fp32", "bf16", "fp16")


def group_state_names(group: dict[str, Any]) -> tuple[str, ...]:
    """The per-element state of a param group: Muon's or AdamW's."""
    return muon.STATE_NAMES if group["use_muon"] else adam.STATE_NAMES


class DistributedFusedMuon(DistributedOptimizer):
    """ZeRO-sharded Muon: ``FusedMuon``'s algorithm, each matrix orthogonalized once, whole, by
    the rank that owns it (see Note: whole matrices on one rank); AdamW for the param groups
    marked ``use_muon=False`` (element-sharded, ``DistributedFusedAdam``'s kernels).

    The constructor takes ``FusedMuon``'s arguments and defaults (torch.optim.Muon's) and its
    param groups (``shardopt.muon_param_groups(model)`` as is), plus the sharding arguments.
    ``state_dict()`` has torch.optim.Muon's format for the Muon groups (``momentum_buffer`` per
    param, no step), so it loads into ``FusedMuon`` and ``torch.optim.Muon``, and theirs load
    here, at any world size.

    The momentum is kept in the param's dtype as torch's (fp32 beside the fp32 masters of
    fp16/bf16 params), or in bf16/fp16 with ``state_format=`` (Apex's ``dtype=torch.bfloat16``
    makes bf16 params their own masters with bf16 momentum: torch's bf16 Muon);
    ``store_param_remainders=True`` works for both parts. Not supported, with an error on every
    rank: CPU offload (the whole-matrix step would run on the host), ``capturable=True``,
    ``scaled_fp16`` and ``int8`` states.

    Args:
        params: iterable of params or param-group dicts, as ``FusedMuon``; a group with
            ``use_muon=False`` is AdamW with FusedAdam's keys and defaults.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn,
            ns_dtype, flatten, ns_algorithm, ns_split: as ``FusedMuon``
            (shardopt/algorithms/muon.py).
        **zero_args: the sharding arguments below.

    Raises:
        ValueError: a Muon param with fewer than 2 dims; torch.optim.Muon's hyperparameter
            errors (on every rank, before any other collective).
        NotImplementedError: offload, ``capturable=True``, a blockwise ``state_format``.

    Example:
        >>> groups = shardopt.muon_param_groups(model, adamw_lr=3e-4)  # doctest: +SKIP
        >>> opt = DistributedFusedMuon(groups, lr=0.02)  # doctest: +SKIP
        >>> loss_fn(model(x)).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    #: every name a key may hold; each key keeps only its group's (``group_state_names``)
    state_names = muon.STATE_NAMES + adam.STATE_NAMES
    state_signed = adam.STATE_SIGNED
    compact_storage = True

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = H.lr,
        weight_decay: float = H.weight_decay,
        momentum: float = H.momentum,
        nesterov: bool = H.nesterov,
        ns_coefficients: Any = H.ns_coefficients,
        eps: float = H.eps,
        ns_steps: int = H.ns_steps,
        adjust_lr_fn: str | None = H.adjust_lr_fn,
        ns_dtype: torch.dtype = H.ns_dtype,
        flatten: bool = H.flatten,
        ns_algorithm: str = H.ns_algorithm,
        ns_split: Any = H.ns_split,
        **zero_args,
    ) -> None:
        name = type(self).__name__
        comm.require_initialized(name)
        groups, error = None, None
        try:  # misuse raises on every rank, before the engine's first collective
            hyper = H(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_coefficients=ns_coefficients,
                eps=eps,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
                ns_dtype=ns_dtype,
                flatten=flatten,
                ns_algorithm=ns_algorithm,
                ns_split=ns_split,
            )
            defaults = {**group_defaults(name, hyper, zero_args), "use_muon": True}
            _refuse_settings(name, zero_args)
            groups = _normalized_groups(params)
            for group in groups:
                _check_group(name, group, defaults)
        except (TypeError, ValueError, NotImplementedError) as e:
            error = e
        comm.raise_if_any(error, zero_args.get("process_group"))
        super().__init__(groups, defaults, **zero_args)
        # torch.optim.Muon's state dict has no step; ours keeps one only for the AdamW groups
        self.register_state_dict_post_hook(drop_muon_steps, prepend=True)
        self.register_state_dict_post_hook(_dtypes_back, prepend=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``FusedMuon``'s group entries (checked in ``__init__``): an AdamW group takes
        FusedAdam's defaults and no Muon entries."""
        adamw = param_group.get("use_muon", True) is False
        if adamw:
            param_group = {**ADAMW_DEFAULTS, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["use_muon"] = not adamw
        if adamw:
            for entry in MUON_ONLY:
                group.pop(entry, None)

    def shard_layout(self, group: dict[str, Any]) -> ShardLayout:
        """Muon groups: each param whole on one rank, balanced by its Newton-Schulz FLOPs;
        AdamW groups: element-sharded (see Note: whole matrices on one rank)."""
        if not group["use_muon"]:
            return ElementLayout()
        cost = functools.partial(
            muon.ns_cost,
            flatten=group["flatten"],
            ns_steps=group["ns_steps"],
            ns_algorithm=group["ns_algorithm"],
            ns_split=group["ns_split"],
        )
        return WholeParamLayout(cost=cost)

    def _build(self, name: str) -> None:
        super()._build(name)
        #: per key: (engine param, its fragments on this rank by param range) of each Muon
        #: param this rank owns
        self._owned: dict[int, list[tuple[int, list[Fragment]]]] = {}
        for key in self.keys:
            group = self.param_groups[key.group_index]
            names = group_state_names(group)
            buf = key.buffers
            for state in [n for n in buf.state if n not in names]:
                del buf.state[state]  # (planned for every name: the engine takes one tuple)
                buf.scales.pop(state, None)
            if group["use_muon"]:
                self._owned[key.index] = _owned_params(name, key, self.rank, self.sharded)

    # -- the step --------------------------------------------------------------------------------

    def _update(self, scalars: StepScalars) -> None:
        for key in self.keys:
            group = self.param_groups[key.group_index]
            if not group["use_muon"]:
                for call in self._calls(key):
                    self._adamw_call(group, key.buffers, call, scalars)
        if scalars.found_inf_t is not None and bool(scalars.found_inf_t.item()):
            return  # GradScaler found an inf/nan: the step is skipped on every rank
        for gi, group in enumerate(self.param_groups):
            if group["use_muon"]:
                keys = [k for k in self.keys if k.group_index == gi]
                self._muon_group(group, keys, scalars.grad_scale_t)

    def _muon_group(self, group: dict, keys: list[Key], grad_scale_t: torch.Tensor) -> None:
        """One ``FusedMuon`` step over the params of ``group`` this rank owns."""
        grads, masters, outs, bufs, shaped, finish = [], [], [], [], [], []
        unused = self.update_calls.unused  # see Note: skipped params in update_calls.py
        for key in keys:
            buf = key.buffers
            for i, frags in self._owned[key.index]:
                if i in unused:
                    continue
                p = self.params[i]
                bufs.append(_joined(buf, buf.state["momentum_buffer"], frags).view(p.shape))
                grad = _joined(buf, self._grads(buf), frags).view(p.shape) * grad_scale_t
                grads.append(grad.to(bufs[-1].dtype))  # (torch's: the grad in the buffer's dtype)
                if buf.master_kind == "remainder":
                    pieces = [state_storage.read(buf, state_storage.MASTER, f.shard_range)
                              for f in frags]  # fmt: skip
                    master = torch.cat(pieces)
                else:
                    master = _joined(buf, buf.master, frags)
                masters.append(master.view(p.shape))
                outs.append(_out(buf, frags, p.shape))
                shaped.append(p)
                finish.append((buf, frags, bufs[-1], master, outs[-1] is not None))
        if not shaped:
            return
        batches = shape_batches(shaped, group["flatten"], group["ns_split"])
        outs_or_none = outs if any(o is not None for o in outs) else None
        muon_step(group, grads, masters, outs_or_none, bufs, batches, group["lr"], False)
        for buf, frags, momentum, master, written in finish:
            _write_back(buf, frags, momentum, master, written)

    def _adamw_call(self, group: dict, buf, call, scalars: StepScalars) -> None:
        """``DistributedFusedAdam``'s update of one call of an AdamW key."""
        amp = amp_args(buf, scalars)
        if not state_storage.needs_codec(buf):
            adam.update(
                group,
                call.of(self._grads(buf)),
                call.of(buf.master),
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                call.outs(),
                step=call.step_t(group),
                lr=group["lr"],
                **amp,
            )
            return
        masters = call.of(buf.master)
        kernels.adam_compact(
            [
                call.of(self._grads(buf)),
                masters,
                call.of(buf.remainder) if buf.remainder is not None else [],
                call.of(buf.state["exp_avg"]),
                call.of(buf.state["exp_avg_sq"]),
                [],  # no per-block scales (MOMENTUM_FORMATS)
                [],
            ],
            state_format=buf.storage.state_format,
            **adam.kernel_args(
                group, step=call.step_t(group), lr=group["lr"], device=buf.update_device
            ),
            **amp,
        )
        outs = call.outs()
        if outs is not None and buf.master_kind == "copy":
            for out, master in zip(outs, masters):
                out.copy_(master)

    # -- state I/O -------------------------------------------------------------------------------

    def export_param_groups(self) -> list[dict[str, Any]]:
        """The engine's groups with ``ns_dtype`` by name ("bfloat16"), which a checkpoint's
        JSON holds; ``state_dict()`` gives it back as a torch.dtype (FusedMuon's)."""
        groups = super().export_param_groups()
        for group in groups:
            if isinstance(group.get("ns_dtype"), torch.dtype):
                group["ns_dtype"] = str(group["ns_dtype"]).removeprefix("torch.")
        return groups

    def import_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """The engine's import; ``ns_dtype`` as a torch.dtype or by name."""
        groups = [_with_dtype(g) for g in groups]
        super().import_param_groups(groups)

    def _check_loaded(self, state_dict: dict[str, Any]) -> tuple[list[dict], dict[int, Any]]:
        """Each group's state checked against its own names (Muon's or AdamW's), then the
        engine's checks of the rest."""
        name = type(self).__name__
        state = state_dict["state"]
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            mine = {pid: state[pid] for pid in saved["params"] if pid in state}
            check_state_keys(mine, group_state_names(group), name)
            for p, pid in zip(group["params"], saved["params"]):
                for entry, value in mine.get(pid, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() != p.numel():
                        raise ValueError(
                            f"{name}: state '{entry}' of param {pid} has {value.numel()} "
                            f"elements, the param has {p.numel()}"
                        )
        common = {
            pid: {k: v for k, v in entry.items() if k in COMMON_STATE_KEYS}
            for pid, entry in state.items()
        }
        return super()._check_loaded({**state_dict, "state": common})


def _with_dtype(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with an ``ns_dtype`` given by name as the torch.dtype."""
    name = group.get("ns_dtype")
    if not isinstance(name, str):
        return group
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"ns_dtype {name!r} of a loaded param group is not a torch dtype")
    return {**group, "ns_dtype": dtype}


def _dtypes_back(optimizer: DistributedFusedMuon, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict()``'s groups with ``ns_dtype`` as the torch.dtype, as FusedMuon's."""
    state_dict["param_groups"] = [_with_dtype(g) for g in state_dict["param_groups"]]
    return state_dict


def _refuse_settings(owner: str, zero_args: dict[str, Any]) -> None:
    """The engine settings this class does not support, each with its reason."""
    if zero_args.get("offload") is not None:
        raise NotImplementedError(
            f"{owner} does not offload: Newton-Schulz is a chain of whole-matrix matmuls, which "
            "on the host would take far longer than the step it saves memory for (docs/muon.md, "
            "'Offload'); use offload=None (DistributedFusedAdam offloads the AdamW part of a "
            "model if it is a separate optimizer)"
        )
    if zero_args.get("shard_layout") is not None:
        raise ValueError(
            f"{owner} chooses the layout of each param group itself (Muon groups: "
            "WholeParamLayout, AdamW groups: ElementLayout); leave shard_layout out"
        )
    if zero_args.get("capturable"):
        raise NotImplementedError(
            f"{owner}: capturable=True is not supported (the Muon step reads its lr and a "
            "GradScaler's overflow flag on the host); use capturable=False"
        )
    fmt = zero_args.get("state_format")
    if fmt is not None and fmt not in MOMENTUM_FORMATS or zero_args.get("with_scaled_states"):
        raise NotImplementedError(
            f"{owner}: state_format must be one of {', '.join(MOMENTUM_FORMATS)} (the momentum "
            f"is the stored tensor itself), got {fmt or 'scaled_fp16'!r}"
        )


def _normalized_groups(params: Iterable) -> list[dict[str, Any]]:
    """``params`` as torch.optim takes them, as a list of group dicts with param lists."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        )
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        ps = group["params"]
        out.append({**group, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return out


def _check_group(owner: str, group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """``FusedMuon.add_param_group``'s checks of one group: an AdamW group with FusedAdam's
    defaults, a Muon group with the constructor's."""
    if group.get("use_muon", True) is False:
        adamw = {**ADAMW_DEFAULTS, **group}
        fields = set(adam.Hyperparams.__dataclass_fields__)
        adam.Hyperparams(**{k: v for k, v in adamw.items() if k in fields}).validate(owner)
        return
    group = {**defaults, **group}
    muon.check_group(group, owner)
    for p in group["params"]:
        if p.ndim < 2:
            raise ValueError(
                f"{owner} only supports 2D parameters (and stacks of them: 3 or more dims, one "
                f"matrix per index of the leading dims) whereas we found a parameter with size: "
                f"{p.size()}. Optimize it with AdamW: put it in a param group with "
                "use_muon=False, or build the groups with shardopt.muon_param_groups(model)"
            )


def _owned_params(owner: str, key: Key, rank: int, sharded) -> list[tuple[int, list[Fragment]]]:
    """(engine param, fragments by param range) of each param of a Muon key on ``rank``;
    ValueError (the same on every rank: the plan is) when a param's fragments lie on several
    ranks."""
    by_param: dict[int, list[Fragment]] = {}
    for f in key.layout.fragments:
        by_param.setdefault(f.param, []).append(f)
    owned = []
    for i in key.layout.params:
        frags = sorted(by_param.get(i, []), key=lambda f: f.param_range.start)
        ranks = {f.rank for f in frags}
        if len(ranks) > 1:
            raise ValueError(
                f"{owner}: Muon param {sharded.all_index[i]} {tuple(sharded.params[i].shape)} is "
                f"split over ranks {sorted(ranks)}; its key's layout must keep each param whole "
                "on one rank (shard_layout: WholeParamLayout)"
            )
        if ranks == {rank}:
            owned.append((i, frags))
    return owned


def _joined(buf, shard, frags: list[Fragment]) -> torch.Tensor:
    """A param's elements of ``shard``: the view of its one fragment, or (a param spread over
    buckets of a one-rank world) a copy of its fragments back to back."""
    if len(frags) == 1:
        return buf.fragment(shard, frags[0])
    return torch.cat([buf.fragment(shard, f) for f in frags])


def _out(buf, frags: list[Fragment], shape: torch.Size) -> torch.Tensor | None:
    """The sync-space view the update writes a separate master's param into (one fragment;
    else None: ``_write_back`` copies it)."""
    if buf.master_kind != "copy" or buf.out_by_copy or len(frags) != 1:
        return None
    f = frags[0]
    start = buf.layout.buckets[f.bucket].space_range.start + f.bucket_range.start
    return buf.sync_space.narrow(0, start, f.bucket_range.numel).view(shape)


@torch.no_grad()
def _write_back(buf, frags: list[Fragment], momentum: torch.Tensor, master: torch.Tensor,
                written: bool) -> None:  # fmt: skip
    """Stores what ``_joined`` copied, and the param-sync copy of a separate master that the
    update did not write (``written``: it did)."""
    sizes = [f.param_range.numel for f in frags]
    masters = master.reshape(-1).split(sizes)
    if len(frags) > 1:
        for f, b in zip(frags, momentum.reshape(-1).split(sizes)):
            buf.fragment(buf.state["momentum_buffer"], f).copy_(b)
    if buf.master_kind == "remainder":
        for f, m in zip(frags, masters):
            state_storage.write(buf, state_storage.MASTER, f.shard_range, m, restore_weights=True)
        return
    if len(frags) > 1:
        for f, m in zip(frags, masters):
            buf.fragment(buf.master, f).copy_(m)
    if buf.master_kind == "copy" and not buf.out_by_copy and not written:
        for f, m in zip(frags, masters):
            start = buf.layout.buckets[f.bucket].space_range.start + f.bucket_range.start
            buf.sync_space.narrow(0, start, f.bucket_range.numel).copy_(m)


show_sharding_args(DistributedFusedMuon, DistributedOptimizer.__init__, APEX_DEFAULTS)
