"""The ZeRO parity suite on GPUs: ``torchrun --nproc-per-node 2 tests/zero/nccl_parity.py``.

Runs every case of test_zero_parity.py and test_muon_zero.py's NCCL_CASES (DistributedFusedMuon)
on CUDA tensors over NCCL (the gloo suites' twin), plus the CUDA-only cases below (CUDA-graph
capture), and prints one line per case; exits non-zero if any case fails.
"""

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

# this folder (test_zero_parity) and tests/ above it (dist_harness, which test_zero_parity imports)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import test_muon_zero  # noqa: E402
import test_zero_parity  # noqa: E402

import shardopt  # noqa: E402


def capture_full_iteration(rank: int, world: int) -> None:
    """A whole iteration (forward, backward with its bucket reduce-scatters, the step and its
    all-gathers) captured in one CUDA graph and replayed equals the same iterations run eagerly,
    including an lr change written into the lr tensor between replays."""
    dev = torch.device("cuda", torch.cuda.current_device())
    for cls in (shardopt.DistributedFusedAdam, shardopt.DistributedFusedLAMB):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(dev)
        ref = copy.deepcopy(model)
        lr = torch.tensor(1e-2, device=dev)
        common = dict(weight_decay=0.1, bucket_cap_mb=0.02)  # several buckets
        opt = cls(model.parameters(), lr=lr, capturable=True, **common)
        ref_opt = cls(ref.parameters(), lr=1e-2, **common)

        def batch(i: int) -> torch.Tensor:
            gen = torch.Generator(device=dev).manual_seed(100 * i + rank)
            return torch.randn(32, 64, device=dev, generator=gen)

        static_x = torch.zeros(32, 64, device=dev)

        def iteration(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor) -> None:
            m(x).square().mean().backward()
            o.step()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, as torch's capture recipe asks
            for i in range(3):
                static_x.copy_(batch(i))
                iteration(model, opt, static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            iteration(model, opt, static_x)
        for i in range(3, 8):
            if i == 5:
                lr.fill_(5e-3)
            static_x.copy_(batch(i))
            graph.replay()
        for i in range(8):
            if i == 5:
                ref_opt.param_groups[0]["lr"] = 5e-3
            iteration(ref, ref_opt, batch(i))
        torch.cuda.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert float(opt.param_groups[0]["step"]) == 8.0


CUDA_CASES = [capture_full_iteration]


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    cases = list(test_zero_parity.CASES) + list(test_muon_zero.NCCL_CASES) + CUDA_CASES
    for case in cases:
        try:
            case(rank, world)
            ok = torch.tensor([1.0], device="cuda")
        except Exception:
            traceback.print_exc()
            ok = torch.tensor([0.0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        failed += ok.item() == 0
        if rank == 0:
            print(f"{'PASS' if ok.item() else 'FAIL'} {case.__name__} (NCCL, world {world})")
    if rank == 0:
        print(f"{len(cases) - failed} passed, {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
