"""``nccl_ub=True`` on one GPU (NCCL, world 1): the collectives' buffers come from a
torch.cuda.MemPool of ncclMemAlloc memory registered with the NCCL process group, through torch's
NCCL allocator where it works, else shardopt's own (csrc/dist/nccl_allocator.cpp). The integrator
runs these on the H200 (torch 2.11+cu130, whose NCCL allocator reports "not supported"); they are
skipped without CUDA. Each runs in a subprocess: one NCCL process group per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PRELUDE = textwrap.dedent(
    """
    import os, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    import shardopt
    from shardopt.zero.apex import user_buffers
    torch.cuda.set_device(0)
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).cuda()

    def in_pool(t, segments):
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(s["address"] <= start and end <= s["address"] + s["total_size"]
                   for s in segments)
    """
)


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body) + "\ndist.destroy_process_group()\nprint('DONE')\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0 and "DONE" in out.stdout, out.stdout + out.stderr
    return out.stdout


def test_grad_buckets_come_from_the_registered_pool():
    """The persistent grad buckets, the grad shard and the param buffers lie in the pool's
    segments, the pool is registered, the state is outside it, and training gives the bits of
    nccl_ub=False."""
    _run(
        """
        reason = user_buffers.missing(torch.device("cuda", 0), [None])
        assert reason is None, reason  # the H200 image must register (ours where torch's fails)
        ub_model, plain_model = model(), model()
        ub = shardopt.DistributedFusedAdam(ub_model.parameters(), lr=1e-2, nccl_ub=True,
                                           contiguous_grad_buffer=True,
                                           bucket_cap_mb=64 * 65 * 4 / 2**20)
        plain = shardopt.DistributedFusedAdam(plain_model.parameters(), lr=1e-2,
                                              bucket_cap_mb=64 * 65 * 4 / 2**20)
        pool = ub._user_buffers
        assert pool.registered
        segments = pool.pool.snapshot()
        assert segments, "the pool holds no segment"
        for key in ub.keys:
            buf = key.buffers
            assert len(buf._grad_store) == len(key.layout.buckets) > 1
            for t in buf._grad_store.values():
                assert in_pool(t, segments), "a grad bucket outside the registered pool"
            assert in_pool(buf.grad_shard, segments)
            assert in_pool(buf.param_space, segments)
            for s in buf.state.values():
                assert not in_pool(s, segments), "optimizer state in the pool"
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(16, 64, device="cuda")
            for m, o in ((ub_model, ub), (plain_model, plain)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
            for p, q in zip(ub_model.parameters(), plain_model.parameters()):
                assert torch.equal(p, q)
        for key in ub.keys:  # the buckets the reduce-scatters used are still the pool's
            for t in key.buffers._grad_store.values():
                assert in_pool(t, segments)
        print("torch allocator:", end=" ")
        try:
            comm_backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
            comm_backend.mem_allocator
            print("yes")
        except Exception as e:
            print("no:", str(e).splitlines()[0])
        """
    )


def test_own_allocator_serves_a_pool():
    """shardopt's allocator (built with the CUDA kernels when nccl.h is found) gives
    ncclMemAlloc memory through torch.cuda.MemPool, whatever torch's NCCL allocator does."""
    _run(
        """
        own, reason = user_buffers._own_allocator()
        assert own is not None, reason
        pool = torch.cuda.MemPool(own)
        with torch.cuda.use_mem_pool(pool):
            t = torch.full((1 << 20,), 3.0, device="cuda")
        segments = pool.snapshot()
        assert in_pool(t, segments)
        backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
        backend.register_mem_pool(pool)  # what nccl_ub=True does with it
        dist.all_reduce(t)  # a collective on registered memory (world 1: the sum is t)
        torch.cuda.synchronize()
        assert torch.equal(t, torch.full_like(t, 3.0))
        backend.deregister_mem_pool(pool)
        del t
        """
    )
