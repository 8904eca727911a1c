"""NCCL user-buffer registration: Apex's ``nccl_ub=True``.

NCCL moves a collective's data with fewer copies and fewer SMs when its send and receive buffers
are registered with the communicator (zero-copy transfers, NVLS and CollNet algorithms). torch
exposes registration as a CUDA memory pool made with an allocator of ``ncclMemAlloc`` memory and
registered with ``ProcessGroupNCCL.register_mem_pool``; NCCL then finds a buffer's registration
from its address at each collective. The allocator is the NCCL backend's own
(``ProcessGroupNCCL.mem_allocator``) where torch has it, else shardopt's
(csrc/dist/nccl_allocator.cpp: ``ncclMemAlloc``/``ncclMemFree`` of the process's NCCL behind
``torch.cuda.memory.CUDAPluggableAllocator``), as Apex ships its own: some torch builds (torch
2.11+cu130) report "NCCL mem allocator is not supported in this NCCL version" while their NCCL
has both functions. ``nccl_ub=True`` is refused only where NCCL itself lacks them (before 2.19),
torch lacks ``MemPool`` or ``register_mem_pool``, or shardopt was built without nccl.h.

With ``nccl_ub=True`` every buffer the engine's collectives read or write is carved from one such
pool, registered once when the optimizer is built: the param buffers the all-gathers fill (and
the param-sync buffers, when separate) and, instead of the transient per-bucket grad buffers,
persistent grad buckets and a persistent grad shard. Apex likewise needs its contiguous grad
buffer for ``nccl_ub``; the price is the grad buffer's bytes (one grad per param in the grad-sync
dtype, plus this rank's shard of it), which ``memory_bytes()`` then counts. Later reduce-scatters
of an accumulation round's extra partial sums use unregistered scratch (NCCL takes both kinds).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterator, Sequence

import torch

from shardopt.zero import comm


def check(owner: str, device: torch.device, groups: Sequence[comm.ProcessGroup | None]) -> None:
    """Raises, naming ``nccl_ub``, unless every group is NCCL, the params are on CUDA and this
    torch exposes registration through the NCCL memory pool."""
    if device.type != "cuda":
        raise ValueError(
            f"{owner}: nccl_ub=True registers CUDA buffers with NCCL, but the params are on "
            f"{device}; use nccl_ub=False"
        )
    for group in groups:
        name = comm.backend(group)
        if name != "nccl":
            raise ValueError(
                f"{owner}: nccl_ub=True needs NCCL process groups, but one uses {name!r}; use "
                "nccl_ub=False"
            )
    reason = missing(device, groups)
    if reason is not None:
        raise NotImplementedError(
            f"{owner}: nccl_ub=True needs NCCL user-buffer registration (a torch.cuda.MemPool "
            "of ncclMemAlloc memory registered with register_mem_pool), which is not available "
            f"with torch {torch.__version__} here ({reason}); use nccl_ub=False"
        )


def missing(device: torch.device, groups: Sequence[comm.ProcessGroup | None]) -> str | None:
    """Why this torch and NCCL cannot register user buffers for ``groups`` (None: they can)."""
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
        return "no torch.cuda.MemPool"
    for group in groups:
        backend = comm.device_backend(group, device)
        if not hasattr(type(backend), "register_mem_pool"):
            return f"{type(backend).__name__} has no register_mem_pool"
    _, reason = allocator(comm.device_backend(groups[0], device))
    return reason


def allocator(backend) -> tuple[object | None, str | None]:
    """(the allocator of NCCL memory for the pool, None) or (None, why there is none): the NCCL
    backend's own where torch has it, else shardopt's (see the module docstring)."""
    try:
        return backend.mem_allocator, None
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        torch_reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    own, reason = _own_allocator()
    if own is not None:
        return own, None
    return None, f"{torch_reason}; and {reason}"


_OWN: list = []  # the one CUDAPluggableAllocator of this process (torch keeps it alive)


def _own_allocator() -> tuple[object | None, str | None]:
    if _OWN:
        return _OWN[0], None
    from shardopt import kernels as _ops

    path = _ops.extension().__file__
    library = ctypes.CDLL(path)
    if not hasattr(library, "shardopt_nccl_mem_alloc"):
        return None, (
            "shardopt's extension was built without its NCCL allocator (no nccl.h found at "
            "build time: install torch's nvidia-nccl wheel or set NCCL_INCLUDE_DIR, and rebuild)"
        )
    version = library.shardopt_nccl_version()
    if version == 0:
        return None, "this process's NCCL has no ncclMemAlloc (NCCL 2.19 or later has it)"
    own = torch.cuda.memory.CUDAPluggableAllocator(
        path, "shardopt_nccl_mem_alloc", "shardopt_nccl_mem_free"
    ).allocator()
    _OWN.append(own)
    return own, None


class UserBuffers:
    """One NCCL-allocated memory pool: what is allocated inside ``allocating()`` comes from it;
    ``register()`` registers it with every group's communicator (deregistered when the owner is
    collected). Build it after ``check``, on every rank."""

    def __init__(
        self, owner: str, device: torch.device, groups: Sequence[comm.ProcessGroup | None]
    ) -> None:
        self.owner = owner
        self.device = device
        self.backends = [comm.device_backend(g, device) for g in groups]
        self.groups = list(groups)
        nccl_allocator, reason = allocator(self.backends[0])
        if nccl_allocator is None:  # check() said it can
            raise NotImplementedError(f"{owner}: nccl_ub=True: {reason}")
        with torch.cuda.device(device):
            self.pool = torch.cuda.MemPool(nccl_allocator)
        self.registered = False

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.use_mem_pool(self.pool):
            yield

    def register(self, owner_object: object) -> None:
        """Registers every segment of the pool with each group's communicator (the communicators
        exist: the params were broadcast over these groups). Collective: a rank whose NCCL
        refuses makes every rank raise."""
        error = None
        done = []
        try:
            for backend in self.backends:
                backend.register_mem_pool(self.pool)
                done.append(backend)
        except Exception as e:  # noqa: BLE001 (NCCL's DistBackendError and its kin)
            error = RuntimeError(f"{self.owner}: nccl_ub=True: NCCL refused the registration: {e}")
        if error is not None:
            _deregister(self.pool, done)
        comm.raise_if_any(error, self.groups[0])
        self.registered = True
        finalizer = weakref.finalize(owner_object, _deregister, self.pool, done)
        finalizer.atexit = False  # at exit the communicators may be gone first

    def segments(self) -> int:
        """Segments of the pool (what registration covers)."""
        return len(self.pool.snapshot())


def _deregister(pool, backends) -> None:
    for backend in backends:
        try:
            backend.deregister_mem_pool(pool)
        except Exception:  # noqa: BLE001 (the process group was destroyed first)
            pass
