"""Every kernel of ``shardopt._C`` as a ``torch.library`` custom op ``shardopt::<name>``, for
``torch.compile``; generated from the kernel specs (``kernels.specs``), not restated.

Each op's schema is its spec's: the kernel's tensor lists (the optional out slot an always-present
``outs`` list, empty when absent), per-tensor vectors and scalars, with the lists and tensors the
kernel writes declared mutated. The fake (meta) implementation allocates only what the kernel
returns (``specs.KernelSpec.fake_results``: lamb_stage1's and norm's sums, with the kernel's
shape, dtype and device), so Dynamo and AOTAutograd trace a call without running it and the
compiled graph calls the kernel as one opaque node. The real implementation is
``dispatch.run``, as for an eager call.

``shardopt.kernels.ops`` routes its wrappers here (``trace``) only while Dynamo traces
(``torch.compiler.is_compiling()``); eager calls go straight to the kernels (no dispatcher
overhead). This module registers the ops when first imported, which ``ops`` does at the first
traced call, so ``import shardopt`` does not pay for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from shardopt.kernels import dispatch
from shardopt.kernels.specs import SPECS, KernelSpec, results_dtype

OptTensor = Tensor | None


def _define(spec: KernelSpec) -> torch.library.CustomOpDef:
    """The custom op of ``spec``, its real and its fake implementation."""
    n_slots = len(spec.slots)
    n_vec = len(spec.vectors)

    def real(*args, **kwargs):
        names = (spec.slots + spec.vectors + spec.args)[len(args) :]
        values = list(args) + [kwargs[k] if k in kwargs else spec.defaults[k] for k in names]
        lists = [list(s) for s in values[:n_slots]]
        if spec.has_out and not lists[-1]:
            lists.pop()
        results = dispatch.run(
            spec, lists, values[n_slots : n_slots + n_vec], values[n_slots + n_vec :]
        )
        if results is None:
            return None
        # the CUDA kernels' results can be rows of one tensor: outputs must not alias
        return tuple(r if i == 0 else r.clone() for i, r in enumerate(results))

    def fake(*args, **kwargs):  # the list arguments come first, positional
        if not spec.returns:
            return None
        tensors = list(args[0]) if spec.flat else list(args[spec.param_slot])
        device = tensors[0].device if tensors else torch.device("cpu")
        dtype = results_dtype(tensors, every=spec.mixed_dtypes)
        return spec.fake_results(len(tensors), dtype, device)

    real.__name__ = real.__qualname__ = spec.name
    real.__doc__ = spec.doc
    op = torch.library.custom_op(
        f"shardopt::{spec.name}",
        real,
        mutates_args=spec.mutated,
        device_types=None,
        schema=spec.op_schema,
    )
    op.register_fake(fake)
    return op


OPS: dict[str, torch.library.CustomOpDef] = {name: _define(spec) for name, spec in SPECS.items()}


def _by_out(
    slots: list[list[Tensor]], outs: list[Tensor | None], vectors: Sequence[OptTensor]
) -> Iterator[tuple[list[list[Tensor]], list[Tensor], list[OptTensor], Tensor | None]]:
    """(slots, outs, per-tensor vectors, positions or None for all) of the positions with an out,
    then of those without.

    A group mixing params with and without masters has None entries in its out slot, which the
    ops' ``Tensor[]`` cannot hold (and torch 2.13's auto-functionalization of a mutated
    ``Tensor?[]`` fails), so each kind gets its own call, as the eager path splits by dtype.
    """
    have = [o is not None for o in outs]
    if all(have) or not any(have):
        yield slots, list(outs) if any(have) else [], list(vectors), None
        return
    device = next((v.device for v in vectors if v is not None), None)
    for kind in (True, False):
        idx = [i for i, h in enumerate(have) if h == kind]
        positions = torch.tensor(idx, device=device) if device is not None else None
        vecs = [None if v is None else v.index_select(0, positions) for v in vectors]
        sub = [[s[i] for i in idx] for s in slots]
        yield sub, [outs[i] for i in idx] if kind else [], vecs, positions


def trace(spec: KernelSpec, lists, vectors: Sequence[OptTensor], args: Sequence) -> tuple | None:
    """What a wrapper of ``shardopt.kernels.ops`` calls while Dynamo traces: the custom op over
    the same arguments (``lists`` as the wrapper takes them, out slot optional)."""
    op = OPS[spec.name]
    if spec.flat:
        tensors = list(lists[0])
        if not tensors:  # as the eager wrapper: nothing to trace
            return spec.empty_results()
        return op(tensors, *vectors, *args)
    depth = len(spec.slots) - spec.has_out
    slots = [list(s) for s in lists[:depth]]
    if not spec.has_out:
        return op(*slots, *vectors, *args)
    outs = list(lists[depth]) if len(lists) > depth and lists[depth] is not None else []
    for sub, sub_outs, vecs, positions in _by_out(slots, outs, vectors):
        op(*sub, sub_outs, *vecs, *args)
        if positions is not None:  # the op wrote a copy of these entries of its vectors
            for k in spec.vector_writes:
                vectors[k].index_copy_(0, positions, vecs[k])
    return None
