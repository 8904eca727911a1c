"""torch.distributed.checkpoint (DCP) interop: the optimizer's state as DTensors.

``sharded_state_dict(optimizer, model)`` returns the optimizer state in the layout torch's
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives a ``torch.optim``
optimizer: ``{"state": {fqn: {name: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}``,
where every state tensor (``exp_avg``, ..., and ``master_param`` for params with a separate fp32
master) is a param-shaped DTensor sharded ``Shard(0)`` over a 1-D device mesh of the optimizer's
process group (0-dim params: ``Replicate()``), and ``step`` is each param's own step (a plain
0-dim tensor). ``dcp.save`` / ``dcp.async_save`` take it as it is, ``dcp.load`` reshards it to any
world size and bucket size, and ``dcp_to_torch_save`` turns it into a torch.optim state dict keyed
by FQN (loadable into ``torch.optim.AdamW`` with ``set_optimizer_state_dict``).

Note: re-partition. Each rank owns arbitrary flat fragments of each param (see
``shardopt/zero/layout.py``: chunk r of every bucket), which no regular DTensor sharding
describes. At save time the state is re-partitioned into the even row chunks of ``Shard(0)``
(``torch.chunk`` semantics: rank r holds rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / world)``),
With a ``redundant_process_group`` (HSDP) the mesh is 2-D, (replicate, shard), placements
``(Replicate(), Shard(0))``: every replica holds the same chunks and DCP writes them once.
and back at load time: params are taken in batches of at most ``bucket_cap_mb`` of fp32 per
state tensor; for each batch every rank writes what it has into a zeroed buffer, one all-reduce
(SUM over the process group; each element has exactly one owner, so the sum is exact) makes the
batch whole on every rank, and each rank copies out what it needs. Cost per save or load: one
all-reduce of the whole optimizer state (about 2x the state bytes sent per rank, as
``state_dict()``), transient device memory of one batch, and host-side copies of this rank's
1/world of the state in the DTensors (a copy, not views of the optimizer's buffers).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

MASTER = "master_param"


def _mesh(optimizer):
    """The optimizer's device mesh: 1-D over the process group, or (replica, shard) with a
    ``redundant_process_group`` (HSDP), where every replica holds the same row chunks."""
    from torch.distributed.device_mesh import DeviceMesh

    group = optimizer.process_group if optimizer.process_group is not None else dist.group.WORLD
    replicas = optimizer.redundant_process_group
    if replicas is None:
        return DeviceMesh.from_group(group, optimizer.device.type)
    # row i of the mesh: the shard group of the replica group's i-th rank
    rows = [None] * dist.get_world_size(replicas)
    dist.all_gather_object(rows, dist.get_process_group_ranks(group), group=replicas)
    return DeviceMesh.from_group(
        [replicas, group],
        optimizer.device.type,
        mesh=torch.tensor(rows, dtype=torch.int),
        mesh_dim_names=("replicate", "shard"),
    )


def _fqns(optimizer, model) -> list[str]:
    """A name for every param of ``optimizer.all_params``: the model's FQN, else the index."""
    names = [str(i) for i in range(len(optimizer.all_params))]
    if model is None:
        return names
    index = {id(p): i for i, p in enumerate(optimizer.all_params)}
    for fqn, p in _named_parameters(model):
        i = index.get(id(p))
        if i is not None and names[i] == str(i):
            names[i] = fqn
    return names


def _named_parameters(model):
    """(fqn, param) pairs without wrapper prefixes (DDP's ``module.``, compile's ``_orig_mod.``)."""
    for fqn, p in model.named_parameters(remove_duplicate=True):
        parts = [s for s in fqn.split(".") if s not in ("module", "_orig_mod")]
        yield ".".join(parts), p


def _names(optimizer, p: torch.Tensor) -> list[str]:
    names = list(optimizer.state_names)
    sync = getattr(optimizer.config, "param_sync_dtype", None)
    if p.dtype != torch.float32 or sync not in (None, p.dtype):
        names.append(MASTER)  # a separate fp32 master (else the param itself is the master)
    return names


def _row_chunk(p: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """This rank's flat element range of ``p`` under ``Shard(0)`` (torch.chunk semantics); the
    whole param for a 0-dim one (``Replicate()``)."""
    if p.dim() == 0:
        return 0, 1
    rows = p.shape[0]
    row = p.numel() // rows if rows else 0
    c = math.ceil(rows / world) if rows else 0
    r0 = min(rank * c, rows)
    r1 = min(r0 + c, rows)
    return r0 * row, r1 * row


def _batches(optimizer, trainable: list[int]) -> list[list[int]]:
    cap = max(1, int(optimizer.bucket_cap_mb * 2**20 / 4))
    out, cur, n = [], [], 0
    for i in trainable:
        numel = optimizer.all_params[i].numel()
        if cur and n + numel > cap:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += numel
    if cur:
        out.append(cur)
    return out


def _exchange(optimizer, direction: str, locals_: dict[int, dict[str, torch.Tensor]]) -> None:
    """Moves state between the optimizer's fragments and the row chunks in ``locals_`` (param
    index -> name -> flat local tensor), in batches (see Note: re-partition). ``direction`` is
    ``"save"`` (fragments -> chunks) or ``"load"`` (chunks -> fragments). Collective."""
    rank, world = optimizer.rank, optimizer.world_size
    frags: dict[int, list] = {}
    for frag in optimizer.shard_fragments(writable=direction == "load"):
        frags.setdefault(frag.param, []).append(frag)
    trainable = sorted(locals_)
    for batch in _batches(optimizer, trainable):
        names = sorted({n for i in batch for n in locals_[i]})
        offsets, total = {}, 0
        for i in batch:
            offsets[i] = total
            total += optimizer.all_params[i].numel()
        buf = torch.zeros(len(names), total, dtype=torch.float32, device=optimizer.device)
        for i in batch:
            base = offsets[i]
            for ni, name in enumerate(names):
                if name not in locals_[i]:
                    continue
                if direction == "save":
                    for frag in frags.get(i, []):
                        r = frag.param_range
                        buf[ni, base + r.start : base + r.end].copy_(frag.tensors[name])
                else:
                    s, e = _row_chunk(optimizer.all_params[i], rank, world)
                    if optimizer.all_params[i].dim() == 0 and rank != 0:
                        continue  # replicated: one contribution
                    buf[ni, base + s : base + e].copy_(locals_[i][name].reshape(-1))
        if world > 1:
            dist.all_reduce(buf, group=optimizer.process_group)
        for i in batch:
            base = offsets[i]
            for ni, name in enumerate(names):
                if name not in locals_[i]:
                    continue
                if direction == "save":
                    s, e = _row_chunk(optimizer.all_params[i], rank, world)
                    locals_[i][name].reshape(-1).copy_(buf[ni, base + s : base + e])
                else:
                    for frag in frags.get(i, []):
                        r = frag.param_range
                        frag.tensors[name].copy_(buf[ni, base + r.start : base + r.end])


def _local_chunks(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    rank, world = optimizer.rank, optimizer.world_size
    out = {}
    for i, p in enumerate(optimizer.all_params):
        if not p.requires_grad:
            continue
        s, e = _row_chunk(p, rank, world)
        out[i] = {
            n: torch.zeros(e - s, dtype=torch.float32, device=optimizer.device)
            for n in _names(optimizer, p)
        }
    return out


def _dtensor(local: torch.Tensor, p: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    replicated = [Replicate()] * (mesh.ndim - 1)  # the replica dim of an HSDP mesh
    if p.dim() == 0:
        return DTensor.from_local(
            local.reshape(()), mesh, replicated + [Replicate()], run_check=False
        )
    shape = (local.numel() // (p.numel() // p.shape[0]) if p.shape[0] else 0, *p.shape[1:])
    return DTensor.from_local(
        local.view(shape),
        mesh,
        replicated + [Shard(0)],
        run_check=False,
        shape=p.shape,
        stride=torch.empty(p.shape, device="meta").stride(),
    )


@torch.no_grad()
def sharded_state_dict(optimizer, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The optimizer state for DCP as DTensors (collective; see the module docstring).

    Args:
        optimizer: a ``DistributedFused*`` optimizer.
        model: the model whose params the optimizer holds: state and param groups are keyed by
            its FQNs (wrapper prefixes ``module.`` and ``_orig_mod.`` removed), as torch's
            ``get_optimizer_state_dict`` keys them. Without it, by param index (``"0"``, ...).
    """
    optimizer.wait_param_sync()
    names = _fqns(optimizer, model)
    chunks = _local_chunks(optimizer)
    _exchange(optimizer, "save", chunks)
    mesh = _mesh(optimizer)
    groups = optimizer.export_param_groups()
    own_steps = {}
    for g in groups:
        steps = g.pop("param_steps", [g["step"]] * len(g["params"]))
        for pid, s in zip(g["params"], steps):
            own_steps[pid] = s
        g["params"] = [names[pid] for pid in g["params"]]
    state: dict[str, dict[str, Any]] = {}
    for i, named in chunks.items():
        p = optimizer.all_params[i]
        entry = {n: _dtensor(t, p, mesh) for n, t in named.items()}
        entry["step"] = torch.tensor(float(own_steps.get(i, 0)))
        state[names[i]] = entry
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_sharded_state_dict(
    optimizer, state_dict: dict[str, Any], model: torch.nn.Module | None = None
) -> None:
    """Finishes a ``dcp.load`` into ``sharded_state_dict()``'s structure (collective): moves the
    loaded row chunks into this rank's fragments, restores the param groups (hyperparameters and
    steps) and writes the masters into the params. Pass the same ``model`` as at save time (the
    keys are FQNs then). Also accepts an older checkpoint's JSON param groups."""
    from torch.distributed.tensor import DTensor

    optimizer.wait_param_sync()
    names = _fqns(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    state = state_dict["state"]
    locals_: dict[int, dict[str, torch.Tensor]] = {}
    own_steps: dict[int, float] = {}
    for fqn, entry in state.items():
        if fqn not in index:
            raise KeyError(f"load_sharded_state_dict: no param named {fqn!r} in the optimizer")
        i = index[fqn]
        p = optimizer.all_params[i]
        locals_[i] = {}
        for n in _names(optimizer, p):
            t = entry.get(n)
            if t is None:
                continue
            local = t.to_local() if isinstance(t, DTensor) else _full_to_chunk(t, p, optimizer)
            locals_[i][n] = local.to(optimizer.device, torch.float32).reshape(-1)
        if "step" in entry:
            own_steps[i] = float(entry["step"])
    _exchange(optimizer, "load", locals_)
    groups = state_dict["param_groups"]
    if isinstance(groups, str):  # the ShardedTensor layout of shardopt <= 0.1 kept JSON text
        groups = json.loads(groups)
    groups = [dict(g) for g in groups]
    for g in groups:
        ids = [index[q] if isinstance(q, str) else int(q) for q in g["params"]]
        g["params"] = ids
        if own_steps and "param_steps" not in g:
            g["param_steps"] = [own_steps.get(pid, g["step"]) for pid in ids]
    optimizer.import_param_groups(groups)
    optimizer.publish_masters()


def _full_to_chunk(t: torch.Tensor, p: torch.Tensor, optimizer) -> torch.Tensor:
    s, e = _row_chunk(p, optimizer.rank, optimizer.world_size)
    return t.reshape(-1)[s:e]


def get_state_dict(model: torch.nn.Module, optimizer, *, options=None):
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for a ``DistributedFused*``
    optimizer: ``(model_state_dict, optimizer_state_dict)`` with the optimizer state sharded
    (``sharded_state_dict(optimizer, model)``). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=options), sharded_state_dict(optimizer, model)


def set_state_dict(
    model: torch.nn.Module, optimizer, *, model_state_dict, optim_state_dict, options=None
):
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for a ``DistributedFused*``
    optimizer (after ``dcp.load`` into ``get_state_dict``'s structure). Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    keys = set_model_state_dict(model, model_state_dict, options=options)
    load_sharded_state_dict(optimizer, optim_state_dict, model)
    return keys
