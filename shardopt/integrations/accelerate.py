"""Hugging Face Accelerate with DistributedFused* optimizers: ``patch(accelerator)``.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    shardopt.integrations.accelerate.patch(accelerator)       # the one added line
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

What the patch changes on this accelerator object only (nothing else, no global state):

- ``prepare_model`` (also through ``prepare``): a model whose trainable params are all held by
  ``DistributedFused*`` optimizers is placed, given autocast etc. as usual but not wrapped in
  ``DistributedDataParallel`` (the optimizer syncs the grads); it gets ``model.no_sync`` =
  ``optimizer.no_sync``, which ``accelerator.no_sync(model)`` and ``accelerator.accumulate(model)``
  use. A model with only some params held raises ``RuntimeError``.
- ``clip_grad_norm_(params, max_norm)``: for the params of such an optimizer it returns
  ``optimizer.clip_grad_norm(max_norm, grad_scaler=accelerator.scaler)`` (the norm of the full
  averaged gradient, unscaled under fp16 AMP as accelerate's is); other params go to accelerate.
- ``clip_grad_value_`` on such params raises ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from shardopt.integrations._owners import owner_of, owners_of, unwrap_ddp
from shardopt.zero import torch_clip as _clip

log = logging.getLogger("shardopt.integrations")


@contextlib.contextmanager
def _without_ddp(accelerator):
    """accelerate wraps a model in DDP for MULTI_GPU/MULTI_CPU/...; NO means no wrapper."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    previous = state.distributed_type
    state.distributed_type = DistributedType.NO
    try:
        yield
    finally:
        state.distributed_type = previous


def _held(model: torch.nn.Module) -> list:
    trainable = [p for p in model.parameters() if p.requires_grad]
    owners = owners_of(trainable)
    if not owners:
        return []
    loose = [p for p in trainable if owner_of(p) is None]
    if loose:
        raise RuntimeError(
            f"shardopt.integrations.accelerate: {len(loose)} of the model's {len(trainable)} "
            f"trainable params are not held by {type(owners[0]).__name__}; a model is either "
            "synced by DistributedFused* optimizers (all its trainable params) or by DDP"
        )
    return owners


def attach_no_sync(model: torch.nn.Module, optimizers: list) -> None:
    """Gives ``model`` a ``no_sync()`` that enters every optimizer's ``no_sync()`` (what
    frameworks call on a DDP model for gradient accumulation)."""

    @contextlib.contextmanager
    def no_sync():
        with contextlib.ExitStack() as stack:
            for opt in optimizers:
                stack.enter_context(opt.no_sync())
            yield

    model.no_sync = no_sync


def patch(accelerator):
    """Makes ``accelerator`` run models held by DistributedFused* optimizers without DDP and
    routes accumulation and clipping to them (see the module docstring). Returns it."""
    if getattr(accelerator, "_shardopt_patched", False):
        return accelerator
    _clip.install()
    original_prepare_model = accelerator.prepare_model
    original_clip = accelerator.clip_grad_norm_
    original_clip_value = accelerator.clip_grad_value_

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        inner = unwrap_ddp(model)
        owners = _held(inner)
        if not owners:
            return original_prepare_model(
                model, device_placement=device_placement, evaluation_mode=evaluation_mode
            )
        if inner is not model:
            log.warning(
                "shardopt: the model given to accelerator.prepare was wrapped in "
                "DistributedDataParallel; using the module inside (DistributedFused* syncs grads)"
            )
        with _without_ddp(accelerator):
            prepared = original_prepare_model(
                inner, device_placement=device_placement, evaluation_mode=evaluation_mode
            )
        attach_no_sync(prepared, owners)
        return prepared

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = list(parameters)
        opt = _clip._route(params, "accelerator.clip_grad_norm_")
        if opt is None:
            return original_clip(params, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0:
            raise RuntimeError(f"{type(opt).__name__} clips by the L2 norm only")
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return opt.clip_grad_norm(float(max_norm), grad_scaler=scaler)
        return opt.clip_grad_norm(float(max_norm))

    def clip_grad_value_(parameters, clip_value):
        params = list(parameters)
        _clip.clip_grad_value_(params, clip_value, _torch=lambda *a: None)
        return original_clip_value(params, clip_value)

    accelerator.prepare_model = prepare_model
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    accelerator._shardopt_patched = True
    return accelerator


def prepare(accelerator, *args: Any, **kwargs: Any):
    """``patch(accelerator).prepare(*args, **kwargs)``."""
    return patch(accelerator).prepare(*args, **kwargs)
