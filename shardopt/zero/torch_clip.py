"""``torch.nn.utils.clip_grad_norm_`` on the params of a DistributedFused* optimizer.

Their grads never appear in ``param.grad`` (they are reduce-scattered into the optimizer's shards
during backward), so torch's function would find no grads, return 0 and clip nothing. ``install()``
(called when the first distributed optimizer is built; later calls do nothing) routes
``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and ``clip_grads_with_norm_``, once per
process. It leaves torch's function objects in place and routes inside them: each is torch's
no-grad wrapper around its body, and the wrapper's reference to the body (its closure cell) is
pointed at a router that calls the body for anything not routed. So every name bound to the
function routes, also one imported before the first optimizer existed (``from torch.nn.utils
import clip_grad_norm_`` at the top of a script), ``clip_grad.clip_grad_norm_`` and the deprecated
``clip_grad_norm``. (Where torch defines them otherwise, the module attributes are replaced
instead, and a warning says that names imported earlier keep torch's function.)

- a call whose params include params of a ``DistributedFused*`` optimizer is routed to
  ``optimizer.clip_grad_norm(max_norm)`` when the params are exactly that optimizer's trainable
  params (``model.parameters()`` of the model it was built on, frozen params allowed): the norm of
  the full averaged gradient is returned and the next ``step()`` clips, as torch would;
- any other mix (a subset of its params, params of two optimizers, or params that have ordinary
  ``.grad``s as well, a ``norm_type`` other than 2) raises ``RuntimeError`` instead of
  silently clipping nothing;
- ``clip_grad_value_`` on such params raises ``RuntimeError``, and so does
  ``clip_grads_with_norm_`` (a norm computed elsewhere; ``get_total_norm`` takes grads, which these
  params do not have).

Calls without such params go to torch's function unchanged. ``error_if_nonfinite`` and
``foreach`` are accepted; with ``error_if_nonfinite=True`` the norm is checked (a host sync).

The switch: ``set_routing(False)`` (or ``SHARDOPT_ROUTE_TORCH_CLIP=0`` in the environment before
the first optimizer is built) makes the wrapper hand every call to torch's function unchanged, as
if it were not there (DistributedFused* grads are then clipped only by
``optimizer.clip_grad_norm``); ``set_routing(True)`` turns it back on. ``routing()`` says which.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from shardopt.zero.sharded_params import owner_of

log = logging.getLogger("shardopt.integrations")

_installed = False
_routing = os.environ.get("SHARDOPT_ROUTE_TORCH_CLIP", "1") != "0"


def set_routing(enabled: bool) -> None:
    """Turns the routing of ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on or off
    (see the module docstring); the wrapper stays installed and passes calls through when off."""
    global _routing
    _routing = bool(enabled)


def routing() -> bool:
    """Whether calls on DistributedFused* params are routed to their optimizer."""
    return _routing


def _as_list(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _route(params: list[torch.Tensor], what: str):
    """The one optimizer owning ``params`` when they are exactly its trainable params; None when
    no param has an owner; else raises."""
    owners = [owner_of(p) for p in params]
    if all(o is None for o in owners):
        return None
    distinct = {id(o): o for o in owners if o is not None}
    if len(distinct) > 1:
        raise RuntimeError(
            f"{what}: the params belong to {len(distinct)} DistributedFused* optimizers; clip "
            "each with optimizer.clip_grad_norm(max_norm)"
        )
    (opt,) = distinct.values()
    name = type(opt).__name__
    stray = [p for p, o in zip(params, owners) if o is None and p.grad is not None]
    if stray:
        raise RuntimeError(
            f"{what}: some params are held by {name}, whose grads live in its shards, and "
            f"{len(stray)} others have .grad; one norm over both is not supported: clip "
            "them separately"
        )
    mine = {id(p) for p, o in zip(params, owners) if o is not None}
    if mine != {id(p) for p in opt.params}:
        raise RuntimeError(
            f"{what}: the params are {len(mine)} of the {len(opt.params)} trainable params of "
            f"{name}; it clips the norm of all its grads only (its grads are not in .grad): "
            "pass all of them (model.parameters()) or call optimizer.clip_grad_norm(max_norm)"
        )
    return opt


def clip_grad_norm_(
    parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, *, _torch=None
):
    params = _as_list(parameters)
    if not _routing:
        return _torch(params, max_norm, norm_type, error_if_nonfinite, foreach)
    opt = _route(params, "torch.nn.utils.clip_grad_norm_")
    if opt is None:
        return _torch(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_norm_: {type(opt).__name__} clips by the L2 norm only, "
            f"got norm_type={norm_type}"
        )
    norm = opt.clip_grad_norm(float(max_norm))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return norm


def clip_grad_value_(parameters, clip_value, foreach=None, *, _torch=None):
    params = _as_list(parameters)
    if not _routing:
        return _torch(params, clip_value, foreach)
    owners = [o for o in map(owner_of, params) if o is not None]
    if owners:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_value_: params held by {type(owners[0]).__name__} have no "
            ".grad (their grads live in its shards) and value clipping is not supported; use "
            "clip_grad_norm_ / optimizer.clip_grad_norm(max_norm)"
        )
    return _torch(params, clip_value, foreach)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None, *, _torch=None):
    params = _as_list(parameters)
    if not _routing:
        return _torch(params, max_norm, total_norm, foreach)
    owners = [o for o in map(owner_of, params) if o is not None]
    if owners:
        raise RuntimeError(
            f"torch.nn.utils.clip_grads_with_norm_: params held by {type(owners[0]).__name__} "
            "have no .grad (their grads live in its shards), so a norm computed from .grad misses "
            "them and there is nothing here to scale; use clip_grad_norm_(model.parameters(), "
            "max_norm) or optimizer.clip_grad_norm(max_norm)"
        )
    return _torch(params, max_norm, total_norm, foreach)


#: torch.nn.utils name -> its router
_ROUTERS = {
    "clip_grad_norm_": clip_grad_norm_,
    "clip_grad_value_": clip_grad_value_,
    "clip_grads_with_norm_": clip_grads_with_norm_,
}


def body_cell(fn):
    """The closure cell through which torch's ``_no_grad`` wrapper ``fn`` calls its body, or None
    where ``fn`` is not such a wrapper (another torch, or another library's function)."""
    code = getattr(fn, "__code__", None)
    if (
        getattr(fn, "__module__", None) != "torch.nn.utils.clip_grad"
        or code is None
        or code.co_name != "_no_grad_wrapper"
        or code.co_freevars != ("func",)
    ):
        return None
    return fn.__closure__[0]


def install() -> None:
    """Routes torch's clip functions (see the module docstring), once per process; later calls
    do nothing."""
    global _installed
    if _installed:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name, ours in _ROUTERS.items():
        fn = getattr(utils, name)
        cell = body_cell(fn)
        if cell is not None:
            if not hasattr(cell.cell_contents, "shardopt_original"):
                routed = functools.partial(ours, _torch=cell.cell_contents)
                routed.shardopt_original = cell.cell_contents
                cell.cell_contents = routed
            continue
        log.warning(
            "torch.nn.utils.%s is not torch's no-grad wrapper; replacing the module attribute "
            "instead: names imported before the first DistributedFused* optimizer was built keep "
            "the function found there",
            name,
        )
        wrapped = functools.wraps(fn)(functools.partial(ours, _torch=fn))
        wrapped.shardopt_original = fn
        setattr(utils, name, wrapped)
        for attr in (name, "_" + name):
            if getattr(clip_grad, attr, None) is fn:
                setattr(clip_grad, attr, wrapped)
    _installed = True
    log.debug("torch.nn.utils.clip_grad_norm_ routes DistributedFused* params to the optimizer")
