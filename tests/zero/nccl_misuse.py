"""Misuse across ranks on GPUs: ``torchrun --nproc-per-node 2 tests/zero/nccl_misuse.py``.

NCCL (gloo on CPU when run without GPUs), where a collective mismatch hangs instead of aborting:
ranks out of lockstep (``zero_grad()`` between backward and ``step()`` on one rank, a skipped
``step()``, also while the other ranks clip first: ``clip_grad_norm()``, ``grad_norm()``,
torch's ``clip_grad_norm_`` routed, a GradScaler with a clip) raise LockstepError naming every
rank; ``state_dict()`` and ``checkpoint.save`` on
rank 0 only raise CollectiveCallError there within the arrival timeout (the store-based check
works on every backend); hyperparameters that differ between ranks fail at construction.
Prints one line per case; exits non-zero if any fails. The gloo versions:
tests/zero/test_lockstep.py, tests/optimizers/test_misuse.py.
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from shardopt import checkpoint
from shardopt.zero.comm import ARRIVAL_TIMEOUT_ENV, CollectiveCallError
from shardopt.zero.lockstep import LockstepError

ARRIVAL_S = 3.0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(_device())


def _opt(model, **kw):
    return shardopt.DistributedFusedAdam(
        model.parameters(), lr=0.01, bucket_cap_mb=64 * 4 / 2**20, **kw
    )


def _backward(model, step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 8, generator=gen).to(_device())).sum().backward()


def _expect(error, run, *fragments):
    try:
        run()
    except error as e:
        for f in fragments:
            assert f in str(e), str(e)
        return
    raise AssertionError(f"no {error.__name__}")


def _deviating_loop(kind, overlap):
    def case(rank, world):
        model = _model()
        opt = _opt(model, overlap_grad_sync=overlap)

        def loop():
            for step in range(3):
                _backward(model, step, rank)
                if rank == world - 1 and step == 1:
                    if kind == "zero_grad":
                        opt.zero_grad()
                    else:
                        continue
                opt.step()
                opt.zero_grad()

        _expect(LockstepError, loop, *(f"rank {r} is " for r in range(world)))

    case.__name__ = f"lockstep_{kind}_{'overlap' if overlap else 'no_overlap'}"
    return case


def _deviating_normed_loop(kind, overlap):
    """The other ranks take the grad norm before each step(); the last rank skips one."""

    def case(rank, world):
        model = _model()
        opt = _opt(model, overlap_grad_sync=overlap)
        scaler = None
        if kind == "scaler_clip":
            scaler = torch.amp.GradScaler(_device().type, init_scale=2.0**4)

        def loop():
            for step in range(3):
                gen = torch.Generator().manual_seed(100 * step + rank)
                loss = model(torch.randn(4, 8, generator=gen).to(_device())).sum()
                (loss if scaler is None else scaler.scale(loss)).backward()
                if rank == world - 1 and step == 1:
                    continue
                if kind == "clip":
                    opt.clip_grad_norm(0.5)
                elif kind == "grad_norm":
                    opt.grad_norm().item()
                elif kind == "torch_clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                else:
                    scaler.unscale_(opt)
                    opt.clip_grad_norm(0.5, grad_scaler=scaler)
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()

        fragments = [f"rank {r} is " for r in range(world)]
        _expect(LockstepError, loop, "is computing the grad norm", *fragments)

    case.__name__ = f"lockstep_skip_step_{kind}_{'overlap' if overlap else 'no_overlap'}"
    return case


def _one_rank(call):
    def case(rank, world):
        model = _model()
        opt = _opt(model)
        _backward(model, 0, rank)
        opt.step()
        os.environ[ARRIVAL_TIMEOUT_ENV] = str(ARRIVAL_S)
        with tempfile.TemporaryDirectory() as tmp:
            path = [os.path.join(tmp, "ckpt")]
            dist.broadcast_object_list(path, src=0)  # one directory, rank 0's
            run = (lambda: opt.state_dict()) if call == "state_dict" else (
                lambda: checkpoint.save(path[0], opt, overwrite=True))  # fmt: skip
            if rank == 0:
                start = time.monotonic()
                _expect(CollectiveCallError, run, "is collective", f"rank {world - 1}")
                assert time.monotonic() - start < ARRIVAL_S + 3.0
            dist.barrier()
            run()  # on every rank: works
            dist.barrier()
        os.environ.pop(ARRIVAL_TIMEOUT_ENV)

    case.__name__ = f"{call}_on_rank0_only"
    return case


def hyperparams_differ(rank, world):
    lr = 2e-3 if rank == world - 1 else 1e-3
    build = lambda: shardopt.DistributedFusedAdam(_model().parameters(), lr=lr)  # noqa: E731
    _expect(ValueError, build, "group 0 lr")


CASES = [
    _deviating_loop("zero_grad", True),
    _deviating_loop("zero_grad", False),
    _deviating_loop("skip_step", True),
    _deviating_loop("skip_step", False),
    *(
        _deviating_normed_loop(kind, overlap)
        for kind in ("clip", "grad_norm", "torch_clip", "scaler_clip")
        for overlap in (True, False)
    ),
    _one_rank("state_dict"),
    _one_rank("save"),
    hyperparams_differ,
]

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torchrun_cases  # tests/zero/, beside this script

    sys.exit(torchrun_cases.run(CASES))
