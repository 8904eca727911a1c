"""The DTensor (FSDP2) cases of tests/optimizers/test_dtensor.py on GPUs under NCCL:
``torchrun --nproc-per-node N tests/optimizers/nccl_dtensor.py`` (gloo on CPU when run without
GPUs).
Prints one line per case; exits non-zero if any fails."""

import os
import sys
import traceback

import torch
import torch.distributed as dist

# this folder (test_dtensor) and tests/ above it (dist_harness, which test_dtensor imports)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import test_dtensor  # noqa: E402


def main() -> int:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        test_dtensor.DEVICE = torch.device("cuda", torch.cuda.current_device())
    failed = 0
    for case in test_dtensor.CASES:
        try:
            case(rank, world)
            status = "PASS"
        except Exception:
            status, failed = "FAIL\n" + traceback.format_exc(), failed + 1
        if rank == 0:
            print(f"{case.__name__} (world {world}, {dist.get_backend()}): {status}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
