"""The Python wrapper of every kernel, generated from its spec (``kernels.specs``): ``adam``,
``adam_compact``, ``adam_blockwise``, ``sgd``, ``adagrad``, ``lamb_stage1``, ``lamb_stage2``,
``novograd``, ``novograd_step``, ``muon_momentum``, ``muon_apply``, ``norm`` and ``scale``.

A wrapper takes the kernel's tensor lists first (``lists``, a sequence of slots with the out slot
optional; ``norm`` its one list ``tensors``), then its per-tensor vectors and scalars, positional
in the spec's order or by name, the spec's defaults filled in, and ``as_is`` (Note: lists passed
as they are, ``kernels.dispatch``). Eagerly it calls ``dispatch.run``; while Dynamo traces it calls
the kernel's custom op (``custom_ops.trace``). ``scale`` also has the argument order the
optimizers use: ``scale(src, dst, found_inf, scale=1.0, scale_t=None)``.

Example:
    >>> grads = [torch.full((3,), 0.5)]
    >>> params, sums = [torch.ones(3)], [torch.zeros(3)]
    >>> adagrad([grads, params, sums], lr=0.1, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False)
    >>> params[0]
    tensor([0.9000, 0.9000, 0.9000])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from shardopt.kernels import dispatch
from shardopt.kernels.specs import SPECS, KernelSpec

__all__ = list(SPECS)


def _signature(spec: KernelSpec) -> inspect.Signature:
    """The wrapper's signature, for help() and IDEs: lists, then the spec's arguments."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    first = "tensors" if spec.flat else "lists"
    params = [inspect.Parameter(first, positional)]
    for name in spec.vectors + spec.args:
        default = spec.defaults.get(name, inspect.Parameter.empty)
        params.append(inspect.Parameter(name, positional, default=default))
    params.append(inspect.Parameter("as_is", inspect.Parameter.KEYWORD_ONLY, default=False))
    return inspect.Signature(params)


def _wrapper(spec: KernelSpec) -> Callable:
    """The Python entry of the kernel of ``spec``."""

    def kernel(lists, *args, as_is: bool = False, **kwargs):
        vectors, values = spec.bind(spec.name, args, kwargs)
        if spec.flat:
            lists = [lists]
        if torch.compiler.is_compiling():  # traced as the custom op shardopt::<name>
            from shardopt.kernels import custom_ops

            return custom_ops.trace(spec, lists, vectors, values)
        return dispatch.run(spec, lists, vectors, values, as_is=as_is)

    kernel.__name__ = kernel.__qualname__ = spec.name
    kernel.__doc__ = f"{spec.doc}\n\nSchema: ``{spec.schema}`` (see shardopt.kernels.specs)."
    kernel.__signature__ = _signature(spec)
    return kernel


adam = _wrapper(SPECS["adam"])
adam_compact = _wrapper(SPECS["adam_compact"])
adam_blockwise = _wrapper(SPECS["adam_blockwise"])
sgd = _wrapper(SPECS["sgd"])
adagrad = _wrapper(SPECS["adagrad"])
lamb_stage1 = _wrapper(SPECS["lamb_stage1"])
lamb_stage2 = _wrapper(SPECS["lamb_stage2"])
novograd = _wrapper(SPECS["novograd"])
novograd_step = _wrapper(SPECS["novograd_step"])
muon_momentum = _wrapper(SPECS["muon_momentum"])
muon_apply = _wrapper(SPECS["muon_apply"])
norm = _wrapper(SPECS["norm"])
_scale = _wrapper(SPECS["scale"])


def scale(
    src: Sequence[Tensor],
    dst: Sequence[Tensor],
    found_inf: Tensor,
    scale: float = 1.0,
    scale_t: Tensor | None = None,
    as_is: bool = False,
) -> None:
    """dst = src * scale (``scale_t`` if given); sets ``found_inf`` to 1 on any inf/nan in src.

    The kernel ``scale`` (its spec's argument order) with the optimizers' order. ``src`` and
    ``dst`` may mix dtypes and layouts (the kernel dispatches per tensor).
    """
    _scale([src, dst], float(scale), scale_t, found_inf, as_is=as_is)
