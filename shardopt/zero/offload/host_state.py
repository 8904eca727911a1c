"""CPU offload, the host side of a key: what moves between its host state and the device.

An offloaded key (``KeyBuffers.offloaded``, see offload_plan.py for which keys) keeps its master,
optimizer state, int16 remainders and per-block scales in host memory (never pinned). The master
is a separate host tensor: fp32 for a ``copy`` key; for a ``param`` key a host copy of this
rank's param chunks (fp32 params: the fp32 master), which takes the param chunks before each
update (the params are the truth, also after a write through ``p.data``), is updated in place
by the same kernels and pushed back into the params' chunks. A ``remainder`` key keeps only its
remainders on the host: the bf16 half of its masters stays in the params and is staged bucket
by bucket around the update (offload_pipeline.py). Per step (the whole-shard path; see Note:
the offloaded step):

  1. ``stage_grads``: the reduce-scattered grad shard comes to the host in its own dtype (bf16
     grads travel as 2 B/param, never upcast on the device), and a ``param`` key's params;
  2. the update rule runs the same kernels as without offload on the host tensors; a ``copy``
     key's kernel writes the new params (param or param-sync dtype, the cast fused in the
     kernel) into ``host_out``, the out slot;
  3. ``publish``: the out slot (or the updated host copy of the params) goes into this rank's
     chunks of the sync space, which the all-gather reads; nothing moves on a skipped step.

On a CPU job the "transfers" are host copies, so the same schedule runs under gloo. The values
the host kernels read from the step (grad scale, found_inf, step, lr) are host tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from shardopt.zero.flat_buffer import KeyBuffers
from shardopt.zero.layout import Range
from shardopt.zero.offload import host_memory


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """The CPU update runs on ``n`` intra-op threads (the offload thread budget); the caller's
    setting is restored after it, so the model's own CPU work is not changed."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on the host (itself on a CPU job; one device-to-host copy on CUDA)."""
    if t is None or t.device.type == "cpu":
        return t
    return t.to("cpu")


@torch.no_grad()
def pull_params(buf: KeyBuffers) -> None:
    """The host copy of a ``param`` key's master takes the params' chunks (at construction and
    whenever the params were written: the params are the truth). A ``remainder`` key keeps no
    copy: its bf16 half is the params' chunks, staged bucket by bucket for the update."""
    if buf.master_kind != "param":
        return
    for bucket, host in zip(buf.layout.buckets, buf.per_bucket(buf.master)):
        host.copy_(buf.chunk(buf.param_space, bucket))


@torch.no_grad()
def push_params(buf: KeyBuffers) -> None:
    """The params' chunks take the host copy of a ``param`` key's master (after state I/O wrote
    the masters)."""
    if buf.master_kind != "param":
        return
    for bucket, host in zip(buf.layout.buckets, buf.per_bucket(buf.master)):
        buf.chunk(buf.param_space, bucket).copy_(host)


@torch.no_grad()
def stage_grads(buf: KeyBuffers) -> None:
    """The grad shard to the host, bucket chunk by bucket chunk, in the grad-sync dtype; a
    ``param`` key's host master takes the params' chunks (a write through ``p.data`` holds)."""
    pull_params(buf)  # see Note: the params are the truth (engine.py)
    n = buf.layout.shard_numel
    host = host_memory.empty(n, buf.grad_dtype, False, what="the step's host copy of the grads")
    for bucket in buf.layout.buckets:
        buf.shard_of_bucket(host, bucket).copy_(buf.shard_of_bucket(buf.grad_shard, bucket))
    buf.host_grad = host
    if buf.master_kind == "copy" and not buf.out_by_copy:
        buf.host_out = host_memory.empty(
            n, buf.sync_space.dtype, False, what="the step's host out slot of the params"
        )


@torch.no_grad()
def publish(
    buf: KeyBuffers, written: Iterable[tuple[Sequence[Range], Sequence[Range]]], skipped: bool
) -> None:
    """The values this step's kernel calls wrote into the sync space: ``written`` holds each
    call's (shard ranges, space ranges), and only those are copied (a skipped param's slot in
    the out slot was never written; ``out_by_copy`` keys are written by
    ``ParamSync.write_sync_space`` from the host masters); frees the step's host buffers."""
    if not skipped and not buf.out_by_copy:
        source = buf.master if buf.master_kind != "copy" else buf.host_out
        for shard_ranges, space_ranges in written:
            for shard_r, space_r in zip(shard_ranges, space_ranges):
                buf.sync_space.narrow(0, space_r.start, space_r.numel).copy_(
                    buf.shard_slice(source, shard_r)
                )
    release(buf)


def release(buf: KeyBuffers) -> None:
    """Frees the step's host grad copy and out slot."""
    buf.host_grad = None
    buf.host_out = None
