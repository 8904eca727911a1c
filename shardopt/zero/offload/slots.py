"""CPU offload, the staging slots: rings of exact-size host buffers between the device and the
host state (see Note: the offloaded step in offload_pipeline.py).

A bucket takes one slot of a ring per direction (its grads down; its new params up; a
``remainder`` key's bf16 params down and up). A slot is reused only once what last used it is
over: the copy that last read or wrote it (a CUDA event), and, since the update runs on its own
thread (offload_worker.py), that update, which the pipeline ensures by never having more buckets
in flight than a ring has slots less one.
"""

from __future__ import annotations

import contextlib

import torch

from shardopt.zero.flat_buffer import ChunkedShard
from shardopt.zero.offload import host_memory


class Slots:
    """A ring of exact-size host buffers of one dtype (page-locked on CUDA when asked: plain
    host memory registered with ``cudaHostRegister``, not torch's power-of-two pinned cache; on
    huge pages when asked: Note: huge pages for host state in host_memory.py)."""

    def __init__(
        self, count: int, numel: int, dtype: torch.dtype, pin: bool, huge_pages: bool = False
    ) -> None:
        self.buffers = [
            host_memory.empty(numel, dtype, huge_pages, what="a staging slot") for _ in range(count)
        ]
        #: per slot: the CUDA event of the copy that last used it (None: none pending)
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            for b in self.buffers:  # flags 0: cudaHostRegisterDefault
                if numel:
                    code = cudart.cudaHostRegister(b.data_ptr(), b.numel() * b.element_size(), 0)
                    if int(code) != 0:
                        raise RuntimeError(f"cudaHostRegister failed with error {int(code)}")
            self.pinned = True
        self.next = 0
        #: (slot, shard offset, elements) -> the slot as a chunk of the shard (see ``shard``)
        self._shards: dict[tuple[int, int, int], ChunkedShard] = {}

    def shard(self, i: int, offset: int, numel: int) -> ChunkedShard:
        """The first ``numel`` elements of slot ``i`` as the chunk of a shard that starts at
        shard element ``offset`` (a bucket's chunk): the same object each time, so the views an
        update takes of it are kept (Note: views kept for the update thread, flat_buffer.py)."""
        tag = (i, offset, numel)
        shard = self._shards.get(tag)
        if shard is None:
            chunk = self.buffers[i][:numel]
            shard = self._shards[tag] = ChunkedShard([chunk], [offset], kept=True)
        return shard

    def take(self) -> tuple[int, torch.Tensor]:
        """The next slot, once the copy that last used it has finished."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        return i, self.buffers[i]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def release(self) -> None:
        if self.pinned:
            cudart = torch.cuda.cudart()
            for b in self.buffers:
                if b.numel():
                    cudart.cudaHostUnregister(b.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()
