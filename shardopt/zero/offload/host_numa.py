"""CPU offload on a host with several NUMA nodes: the host state and the update on the GPU's node.

Note: NUMA placement
    On a host with several NUMA nodes (a two-socket server: each socket with its own DRAM and its
    own PCIe root), the CPU update streams the whole host state once per step at DRAM bandwidth
    (28 B/param for fp32 Adam) and the staging copies cross PCIe to the rank's GPU: both are
    slower from memory or threads on another node. With ``CPUOffload(numa_node="auto")`` (the
    default), an offloaded optimizer whose params are on a CUDA device attached to a node (its
    PCI device's ``numa_node`` in sysfs), on a host with two or more nodes with CPUs and at
    least as many local ranks as such nodes (``LOCAL_WORLD_SIZE``: one rank alone keeps every
    node's cores and bandwidth):

      - allocates its host state and staging slots with their pages preferred on that node
        (``mbind`` with ``MPOL_PREFERRED`` before the fill that first touches them: the kernel
        takes another node's pages when that one is full, rather than failing);
      - runs the update thread (offload_worker.py), and so the intra-op threads its kernels
        start, which inherit its affinity, on that node's CPUs among those the process may use,
        and caps the default thread budget at their number divided by the local ranks placed on
        the node (counted from the visible devices' nodes when every local rank's device is
        visible, else the ranks spread evenly), so ranks whose GPUs share a node do not
        oversubscribe it (LAMB and NovoGrad, which update the whole shard on the main thread, get
        the pages' placement only).

    ``numa_node=<int>`` asks for that node whatever the device (also on a CPU job or a host with
    one node); ``None`` turns placement off. Where the node is unknown (no sysfs entry, -1, torch
    without the device's PCI address), ``"auto"`` places nothing. Placement never changes a
    value, only where pages and threads are; a refused ``mbind`` (a kernel without NUMA, a
    sandbox) is logged once and the pages stay where the OS puts them. Not measured yet on a
    host with several nodes (the one-H200 box has one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("shardopt")

#: Linux's syscall numbers of mbind and get_mempolicy, by machine
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
MPOL_PREFERRED = 1
MPOL_F_ADDR = 2
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_warned: set[str] = set()


@dataclass(frozen=True)
class Placement:
    """Where one optimizer's host state and update go: NUMA ``node``, the ``cpus`` of it the
    update thread runs on, and at most how many ``threads`` the update takes there (its CPUs
    shared among the local ranks placed on it)."""

    node: int
    cpus: frozenset[int]
    threads: int


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist ("0-3,8,10-11"; empty for a node without CPUs)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def node_cpus(sys_root: Path = Path("/sys")) -> dict[int, set[int]]:
    """Each NUMA node of this host with its CPUs (nodes without CPUs left out; {} off Linux)."""
    nodes: dict[int, set[int]] = {}
    root = sys_root / "devices" / "system" / "node"
    for path in sorted(root.glob("node[0-9]*")):
        try:
            cpus = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(path.name[4:])] = cpus
    return nodes


def device_node(device: torch.device, sys_root: Path = Path("/sys")) -> int | None:
    """The NUMA node a CUDA device's PCI device is attached to, if the OS says (else None)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    address = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    try:
        node = int((sys_root / "bus" / "pci" / "devices" / address / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def placement(
    requested: int | str | None,
    device: torch.device,
    local_ranks: int,
    *,
    nodes: dict[int, set[int]] | None = None,
    node: int | None = None,
    allowed: set[int] | None = None,
    device_nodes: list[int | None] | None = None,
) -> Placement | None:
    """The placement of one optimizer (see Note: NUMA placement): ``requested`` is
    ``CPUOffload.numa_node``; ``nodes``, ``node`` (the device's), ``allowed`` (the CPUs this
    process may use) and ``device_nodes`` (each visible CUDA device's node) default to what the
    OS says, and are given in tests."""
    if requested is None:
        return None
    nodes = node_cpus() if nodes is None else nodes
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if requested == "auto":
        if len(nodes) < 2 or local_ranks < len(nodes):
            return None
        node = device_node(device) if node is None else node
        if node is None:
            return None
    else:
        node = int(requested)
    cpus = nodes.get(node, set()) & set(allowed)
    if not cpus:
        if requested != "auto":
            raise ValueError(
                f"CPUOffload.numa_node={requested}: NUMA node {node} has no CPU this process may "
                f"use (nodes with CPUs: {sorted(nodes)}; allowed CPUs: {sorted(allowed)})"
            )
        return None
    # the local ranks on this node: those whose devices are on it when every local rank's device
    # is visible (torchrun: rank r takes cuda:r), else the ranks spread evenly over the nodes
    if device_nodes is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_nodes = [device_node(torch.device("cuda", i)) for i in range(count)]
    if device.type == "cuda" and len(device_nodes) == local_ranks:
        sharing = max(1, sum(n == node for n in device_nodes))
    else:
        sharing = max(1, -(-local_ranks // len(nodes)) if nodes else local_ranks)
    return Placement(node, frozenset(cpus), max(1, len(cpus) // sharing))


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning("shardopt: CPU offload's NUMA placement: %s", what)


def prefer_node(t: torch.Tensor, node: int) -> bool:
    """Marks the whole pages of ``t``'s memory as preferring NUMA ``node`` (``mbind``,
    ``MPOL_PREFERRED``), before they are first touched; False where it cannot (logged once)."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None or os.name != "posix":
        _warn_once(f"no mbind on {platform.machine()}; pages are left where the OS puts them")
        return False
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
    if end <= start:
        return True  # smaller than a page: left to the allocator
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = _libc()
    code = libc.syscall(
        ctypes.c_long(calls[0]), ctypes.c_void_p(start), ctypes.c_ulong(end - start),
        ctypes.c_int(MPOL_PREFERRED), mask, ctypes.c_ulong(words * 64 + 1), ctypes.c_uint(0),
    )  # fmt: skip
    if code != 0:
        _warn_once(f"mbind failed ({os.strerror(ctypes.get_errno())}); pages left to the OS")
        return False
    return True


def policy_of(t: torch.Tensor) -> tuple[int, set[int]]:
    """The memory policy of the page holding ``t``'s first whole page: (mode, nodes)."""
    calls = _SYSCALLS[platform.machine()]
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * 16)()
    code = _libc().syscall(
        ctypes.c_long(calls[1]), ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64 + 1),
        ctypes.c_void_p(start), ctypes.c_ulong(MPOL_F_ADDR),
    )  # fmt: skip
    if code != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    nodes = {w * 64 + b for w in range(16) for b in range(64) if mask[w] >> b & 1}
    return mode.value, nodes


def pin_this_thread(cpus: frozenset[int]) -> None:
    """Runs the calling thread (and the threads it starts later) on ``cpus`` only."""
    try:
        os.sched_setaffinity(0, cpus)  # Linux: 0 is the calling thread
    except (AttributeError, OSError) as e:
        _warn_once(f"could not pin the update thread to CPUs {sorted(cpus)} ({e})")
