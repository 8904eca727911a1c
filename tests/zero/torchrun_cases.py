"""The entry of the torchrun case scripts (tests/zero/nccl_contract.py, tests/zero/apex_script.py).

``run(cases)`` joins the process group torchrun describes (NCCL with one GPU per rank when CUDA
is available, else gloo), runs every ``case(rank, world)`` in order with a barrier after each,
prints ``PASS``/``FAIL`` per case on rank 0 (a failing rank prints its traceback) and returns the
exit status: 1 if any case failed on this rank.
"""

import sys
import traceback

import torch
import torch.distributed as dist


def run(cases) -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    failed = 0
    for case in cases:
        try:
            case(rank, world)
            ok = True
        except Exception:
            ok = False
            failed += 1
            traceback.print_exc()
        if rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} {case.__name__} ({backend}, world {world})")
            sys.stdout.flush()
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0
