"""The DDP-contract cases on GPUs: ``torchrun --nproc-per-node 2 tests/zero/nccl_contract.py``.

NCCL with overlapped grad and param sync (gloo on CPU when run without GPUs): params no rank
computed a grad for are skipped and conditional ones averaged as DDP(find_unused_parameters=True)
+ AdamW does, accumulation without no_sync, in-place param writes and re-bound params seen by the
next step, and reads after step() that see the new values. Prints one line per case; exits
non-zero if any fails.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

import shardopt

TOL = dict(rtol=1.3e-6, atol=1e-5)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b, use_c):
        y = self.a(x)
        if use_b:
            y = self.b(y)
        if use_c:
            y = self.c(y)
        return y.square().mean()


def _x(step, rank, dev):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=gen).to(dev)


def unused_conditional_accumulation(rank, world):
    """Matches DDP(find_unused_parameters=True) + AdamW: c unused for 3 steps on every rank, b
    used on rank 0 only every other step, two synchronised backward passes per step."""
    dev = _device()
    torch.manual_seed(0)
    model = Net().to(dev)
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedAdam(
        model.parameters(),
        lr=0.1,
        weight_decay=0.1,
        bucket_cap_mb=100 * 4 / 2**20,
        overlap_param_sync=True,
    )
    ddp = nn.parallel.DistributedDataParallel(
        ref, find_unused_parameters=True, process_group=dist.new_group()
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(5):
        use_b, use_c = step % 2 == 0 and rank == 0, step >= 3
        for micro in range(2):
            x = _x(step, rank, dev) + micro
            model(x, use_b, use_c).backward()
            ddp(x, use_b, use_c).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.wait_param_sync()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")


def writes_and_rebinds_are_seen(rank, world):
    """bf16 params: an in-place write after step() and a re-bound param are where the next step
    starts from (the fp32 masters do not undo them)."""
    dev = _device()
    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(dev, torch.bfloat16)
    opt = shardopt.DistributedFusedSGD(model.parameters(), lr=0.0, overlap_param_sync=True)
    model(torch.ones(2, 16, device=dev, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    opt.wait_param_sync()
    with torch.no_grad():
        model.weight.fill_(0.5)
    model.bias.data = torch.full_like(model.bias, 0.25)
    model(torch.ones(2, 16, device=dev, dtype=torch.bfloat16)).sum().backward()
    opt.step()  # lr 0: the params must stay what was written
    opt.wait_param_sync()
    assert bool((model.weight == 0.5).all()), model.weight
    assert bool((model.bias == 0.25).all()), model.bias


def reads_after_step_see_new_values(rank, world):
    """overlap_param_sync=True: model.state_dict() right after step() holds the new params."""
    dev = _device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(dev)
    ref = copy.deepcopy(model)
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.1, overlap_param_sync=True)
    ref_opt = shardopt.DistributedFusedAdam(ref.parameters(), lr=0.1)
    for step in range(2):
        model(_x(step, rank, dev)).square().mean().backward()
        ref(_x(step, rank, dev)).square().mean().backward()
        opt.step()
        ref_opt.step()
        state = model.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=0)


def nccl_user_buffers(rank, world):
    """nccl_ub=True (NCCL): buffers carved from the registered NCCL pool give the bits of
    nccl_ub=False through accumulation, an unused module and clipping, in fp32 and bf16; where
    this torch's NCCL has no memory pool, a NotImplementedError giving the reason (gloo: refused
    with an error naming nccl_ub)."""
    dev = _device()
    if dist.get_backend() != "nccl":
        try:
            shardopt.DistributedFusedAdam(Net().parameters(), nccl_ub=True)
        except ValueError as e:
            assert "nccl_ub" in str(e), e
            return
        raise AssertionError("nccl_ub=True was accepted on gloo")
    from shardopt.zero.apex import user_buffers

    reason = user_buffers.missing(dev, [None])
    if reason is not None:  # this torch's NCCL cannot: a clear NotImplementedError, every rank
        try:
            shardopt.DistributedFusedAdam(Net().to(dev).parameters(), nccl_ub=True)
        except NotImplementedError as e:
            assert "nccl_ub" in str(e) and reason in str(e), e
            if rank == 0:
                print(f"nccl_ub=True refused as this torch cannot register: {reason}")
            return
        raise AssertionError(f"nccl_ub=True was accepted although {reason}")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        models = [Net().to(dev, dtype)]
        models.append(copy.deepcopy(models[0]))
        opts = [
            shardopt.DistributedFusedAdam(
                m.parameters(),
                lr=0.1,
                weight_decay=0.1,
                bucket_cap_mb=100 * 4 / 2**20,
                overlap_param_sync=True,
                nccl_ub=ub,
            )  # fmt: skip
            for m, ub in zip(models, (True, False))
        ]
        pool = opts[0]._user_buffers
        assert pool.registered and pool.segments() > 0
        for step in range(4):
            for m, o in zip(models, opts):
                m(_x(step, rank, dev).to(dtype), True, step % 2 == 0).backward()
                m(_x(step + 9, rank, dev).to(dtype), True, True).backward()
                o.clip_grad_norm(1.0)
                o.step()
                o.zero_grad()
                o.wait_param_sync()
            for p, q in zip(*(m.parameters() for m in models)):
                assert torch.equal(p, q), (dtype, step)
        mem = opts[0].memory_bytes()
        assert mem["grad_buckets"] > 0 and "grad_buckets" not in opts[1].memory_bytes()


CASES = [
    unused_conditional_accumulation,
    writes_and_rebinds_are_seen,
    reads_after_step_see_new_values,
    nccl_user_buffers,
]


if __name__ == "__main__":
    import torchrun_cases  # tests/zero/, beside this script

    sys.exit(torchrun_cases.run(CASES))
