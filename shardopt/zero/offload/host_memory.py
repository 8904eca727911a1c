"""CPU offload: the host memory an offloaded key's state lives in.

Note: huge pages for host state
    The CPU update streams the whole host state once per step (28 B/param for fp32 Adam: about
    37 GB for a 1.3B-param shard), bound by DRAM bandwidth. On 4 KiB pages that is a TLB miss
    every 4 KiB of each of its streams, and the hardware prefetchers stop at every page boundary.
    With ``CPUOffload(huge_pages=True)`` (off by default, see below) each host tensor of 2 MiB or
    more (masters, states, remainders, scales, the staging slots) comes from its own anonymous
    mapping advised ``MADV_HUGEPAGE``, so that where the OS has transparent huge pages in
    ``madvise`` or ``always`` mode (/sys/kernel/mm/transparent_hugepage/enabled) it sits on 2 MiB
    pages. Where they are off (``never``), or the platform has no ``MADV_HUGEPAGE``, the advice is
    a no-op and the pages stay 4 KiB: the values never depend on it. Each tensor starts
    ``OFFSETS[k]`` bytes into a huge page (k counting allocations): on 4 KiB pages the physical
    addresses of the update's five streams (grad, master, two moments, out slot) are scattered; on
    2 MiB pages they would share their low 21 bits, and streams read in lockstep would fall into
    the same cache sets and DRAM banks at every element. A tensor keeps its mapping alive; the
    mapping is unmapped when the last view of it is freed. The fill that follows the allocation is
    the pages' first touch, parallel over the update's thread budget (the ``host_state.threads``
    context the engine allocates in); on a host with several NUMA nodes the pages are preferred
    on the placement's node before it (``on_node``, Note: NUMA placement in host_numa.py).

    Measured on the one-H200 box (16 cores, THP ``madvise``; docs/benchmarks.md, "CPU offload"):
    the offload kernel alone over 402M params (launch_scripts/probe/probe_host_pages.py, one round,
    one call) took 113.9 ms on 4 KiB pages, 119.2 ms on 2 MiB-aligned huge pages and 107.1 ms
    staggered. The 1.32B GPT's unclipped offloaded step took 465.4 ms staggered, 492.4 ms on 4 KiB
    pages and 533.1 ms aligned, each in another call (machine). The CUDA test of
    ``fraction="auto"`` (within 10% of no offload on a small model) failed in both calls with huge
    pages (1.28x aligned, 1.17x staggered) and passed in the one without. Until one call measures
    both end to end on the same machine, the default stays on 4 KiB pages.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
from collections.abc import Iterator

import torch

from shardopt.zero.offload import host_numa

#: the size of a transparent huge page on x86-64 and on arm64 with 4 KiB base pages
HUGE_PAGE = 2 << 20
#: smaller tensors stay on torch's allocator (a mapping of their own would waste most of a page)
MIN_BYTES = HUGE_PAGE
#: where successive tensors start within their first huge page: multiples of 16 KiB + 576 B
#: (64 B-aligned; distinct modulo 4 KiB and modulo 128 KiB, an L2 way's span)
OFFSETS = tuple(k * (16 * 1024 + 576) for k in range(7))
_allocations = itertools.count()
#: ``node``: the NUMA node this thread's host tensors are preferred on (``on_node``), or None
_placing = threading.local()


#: what a host tensor is for, when the caller does not say (named when its allocation fails)
STATE = "the CPU offload's host state (masters and optimizer state)"


class HostMemoryError(RuntimeError):
    """A host allocation of CPU offload failed: the message names what it was for, the bytes
    asked for and the remedies (raised on every rank: ``offload_auto.first_touch``)."""


@contextlib.contextmanager
def on_node(node: int | None) -> Iterator[None]:
    """Inside, the host tensors this thread allocates here have their pages preferred on NUMA
    ``node`` before their first touch (None: left to the OS; Note: NUMA placement in
    host_numa.py)."""
    before = getattr(_placing, "node", None)
    _placing.node = node
    try:
        yield
    finally:
        _placing.node = before


def empty(
    numel: int,
    dtype: torch.dtype,
    huge_pages: bool,
    offset: int | None = None,
    what: str = STATE,
) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements; with ``huge_pages`` and 2 MiB or more,
    in its own mapping advised ``MADV_HUGEPAGE``, starting ``offset`` bytes (a multiple of 64;
    default: the next of ``OFFSETS``) into a huge page (Note: huge pages for host state); inside
    ``on_node``, its pages preferred on that NUMA node. Raises ``HostMemoryError`` naming
    ``what`` when the host has not the memory."""
    try:
        t = _mapped(numel, dtype, huge_pages, offset)
    except (RuntimeError, MemoryError, OSError) as e:  # torch's allocator; mmap
        nbytes = numel * dtype.itemsize
        raise HostMemoryError(
            f"CPU offload could not allocate {nbytes:,} bytes of host memory for {what} "
            f"({numel:,} x {dtype}): {str(e).rstrip('.')}. Offload less "
            "(CPUOffload(fraction=...) below 1, or 'auto'), keep less state per param "
            "(state_format='int8' or 'fp16'; store_param_remainders=True for bf16 params), use "
            "fewer staging_slots or a smaller bucket_cap_mb (a slot is a bucket chunk), or more "
            "ranks (each holds 1/N of the state)"
        ) from e
    node = getattr(_placing, "node", None)
    if node is not None:  # before the first touch
        host_numa.prefer_node(t, node)
    return t


def _mapped(numel: int, dtype: torch.dtype, huge_pages: bool, offset: int | None) -> torch.Tensor:
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not huge_pages or nbytes < MIN_BYTES or advice is None:
        return _allocate(numel, dtype)
    if offset is None:
        offset = OFFSETS[next(_allocations) % len(OFFSETS)]
    if offset % 64 or not 0 <= offset < HUGE_PAGE:
        raise ValueError(f"offset must be a multiple of 64 in [0, {HUGE_PAGE}), got {offset}")
    size = nbytes + offset + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages refuses the advice: 4 KiB pages
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region`` while a view lives
    start = (-raw.data_ptr()) % HUGE_PAGE + offset
    return raw[start : start + nbytes].view(dtype)


def _allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Host memory from torch's allocator (tests replace it to make it fail)."""
    return torch.empty(numel, dtype=dtype)


def full(numel: int, dtype: torch.dtype, value: int | float, huge_pages: bool) -> torch.Tensor:
    """A host tensor of ``value``s in ``empty``'s memory (the fill is its first touch)."""
    return empty(numel, dtype, huge_pages).fill_(value)
