"""The ZeRO parity suite on GPUs: ``torchrun --nproc-per-node 2 tests/nccl_parity.py``.

Runs every case of test_zero_parity.py on CUDA tensors over NCCL (the gloo suite's twin) and
prints one line per case; exits non-zero if any case fails.
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import test_zero_parity  # noqa: E402


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    for case in test_zero_parity.CASES:
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
        print(f"{len(test_zero_parity.CASES) - failed} passed, {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
