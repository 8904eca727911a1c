"""The optimizer's state as DTensors for torch.distributed.checkpoint (DCP).

The state-I/O methods ``sharded_state_dict`` / ``load_sharded_state_dict`` of every
DistributedFused* optimizer are these functions; ``shardopt.checkpoint.dcp`` builds torch's
``get_state_dict`` / ``set_state_dict`` pair on them.


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
``shardopt/zero/layout/``: chunk r of every bucket), which no regular DTensor sharding
describes. At save time the state is re-partitioned into the even row chunks of ``Shard(0)``
(``torch.chunk`` semantics: rank r holds rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / world)``),
and back at load time: params are taken in batches of at most ``bucket_cap_mb`` of fp32 per
state tensor, and for each batch one ``all_to_all_single`` over the process group moves every
element from the rank that has it (its fragment's owner at save time, its row chunk's holder at
load time) straight to the rank that needs it. Every rank learns every rank's fragments once per
save or load (one ``all_gather_object`` of (param, start, end) triples), so both sides of each
pair list their pieces in the same order (param, state name, fragment, row chunk). Cost per save
or load: each element crosses the network at most once (about the rank's share of the state sent
and received per rank; a 0-dim param's value goes to every rank), transient device memory of one
batch sent and one received, and host-side copies of this rank's 1/world of the state in the
DTensors (a copy, not views of the optimizer's buffers). With a ``redundant_process_group``
(HSDP) the mesh is 2-D, (replicate, shard), with placements ``(Replicate(), Shard(0))``: every
replica holds the same chunks (the exchange runs inside each shard group) and DCP writes them once.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist


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


def _pieces(p: torch.Tensor, owned: list, i: int, world: int, save: bool) -> list[tuple]:
    """(owner r, its fragment's start a, row-chunk holder s, the chunk's start, piece start,
    piece end) of every overlap of a fragment of param ``i`` with a row chunk, in a fixed order
    (owner, fragment, holder). At load a 0-dim param (every rank's chunk) comes from rank 0."""
    chunks = [_row_chunk(p, s, world) for s in range(world)]
    if not save and p.dim() == 0:
        chunks = chunks[:1]
    out = []
    for r in range(world):
        for a, e in owned[r].get(i, []):
            for s, (c0, c1) in enumerate(chunks):
                if max(a, c0) < min(e, c1):
                    out.append((r, a, s, c0, max(a, c0), min(e, c1)))
    return out


def _exchange(optimizer, direction: str, locals_: dict[int, dict[str, torch.Tensor]]) -> None:
    """Moves state between the optimizer's fragments and the row chunks in ``locals_`` (param
    index -> name -> flat local tensor), in batches (see Note: re-partition). ``direction`` is
    ``"save"`` (fragments -> chunks) or ``"load"`` (chunks -> fragments). Collective."""
    rank, world = optimizer.rank, optimizer.world_size
    group = optimizer.process_group
    save = direction == "save"
    mine = {(f.param, f.param_range.start): f for f in optimizer.shard_fragments(writable=not save)}
    # every rank's fragments, (param, start, end) in its shard order: who owns which elements
    spans: list = [None] * world
    dist.all_gather_object(spans, [(i, a, f.param_range.end) for (i, a), f in mine.items()], group)
    owned: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]
    for r, lst in enumerate(spans):
        for i, a, e in lst:
            owned[r].setdefault(i, []).append((a, e))
    for batch in _batches(optimizer, sorted(locals_)):
        # pieces to send to / receive from each rank, listed in the same order on both sides
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        recv: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for i in batch:
            pieces = _pieces(optimizer.all_params[i], owned, i, world, save)
            for name in sorted(locals_[i]):
                chunk = locals_[i][name].reshape(-1)
                for r, a, s, c0, x, y in pieces:
                    src, dst = (r, s) if save else (s, r)
                    if rank not in (src, dst):
                        continue
                    held = mine[(i, a)].tensors[name][x - a : y - a] if r == rank else None
                    row = chunk[x - c0 : y - c0] if s == rank else None
                    if src == rank:
                        send[dst].append(held if save else row)
                    if dst == rank:
                        recv[src].append(row if save else held)
        sent = [sum(t.numel() for t in lst) for lst in send]
        got = [sum(t.numel() for t in lst) for lst in recv]
        flat = [t.reshape(-1).to(optimizer.device, torch.float32) for lst in send for t in lst]
        out = torch.empty(sum(got), dtype=torch.float32, device=optimizer.device)
        if flat:
            inp = torch.cat(flat)
        else:
            inp = torch.zeros(0, dtype=torch.float32, device=optimizer.device)
        if world > 1:
            dist.all_to_all_single(out, inp, got, sent, group=group)
        else:
            out.copy_(inp)
        offset = 0
        for lst in recv:
            for t in lst:
                t.copy_(out[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _local_chunks(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    rank, world = optimizer.rank, optimizer.world_size
    out = {}
    for i, p in enumerate(optimizer.all_params):
        if not p.requires_grad:
            continue
        s, e = _row_chunk(p, rank, world)
        out[i] = {
            n: torch.zeros(e - s, dtype=torch.float32, device=optimizer.device)
            for n in optimizer.saved_names(i)
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
        for n in optimizer.saved_names(i):
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
    optimizer.publish_masters(restore_weights=True)


def _full_to_chunk(t: torch.Tensor, p: torch.Tensor, optimizer) -> torch.Tensor:
    s, e = _row_chunk(p, optimizer.rank, optimizer.world_size)
    return t.reshape(-1)[s:e]
