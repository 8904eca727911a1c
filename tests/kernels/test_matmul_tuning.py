"""``kernels.set_matmul_tuning``: the opt-in timing of cuBLASLt's heuristic algorithms for
``bmm_add`` and ``symmetric_bmm_add`` (Note: tuning the matmuls in csrc/linalg/lt_matmul.cu).
A tuned product is as close to the exact one as an untuned one, never writes its addend or its
result while timing, keeps its algorithm (the same bits) after the first call, and a case first
met during CUDA graph capture is timed at its first call outside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import CUDA_MARKS
from matmul_numerics import UNIT, gauss, relative

from shardopt import kernels
from shardopt.kernels import matmul

CUDA_MARK, CUDA_SKIP = CUDA_MARKS


@pytest.fixture
def tuning():
    """Sets the tuning for one test and restores the setting before it."""
    before = kernels.matmul_tuning()
    yield kernels.set_matmul_tuning
    kernels.set_matmul_tuning(before)


@pytest.mark.parametrize(
    "bad,error",
    [(-1, ValueError), (33, ValueError), (2.0, TypeError), (True, TypeError), ("8", TypeError)],
)
def test_set_matmul_tuning_names_bad_input(tuning, bad, error):
    with pytest.raises(error, match=r"set_matmul_tuning: candidates must be"):
        tuning(bad)


def test_setting_round_trips(tuning):
    tuning(12)
    assert kernels.matmul_tuning() == 12
    tuning(0)
    assert kernels.matmul_tuning() == 0


def test_environment_sets_the_start():
    code = "from shardopt import kernels; print(kernels.matmul_tuning())"
    env = dict(os.environ, SHARDOPT_MATMUL_TUNING="6")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "6"


@pytest.mark.parametrize("value", ["8x", "-1", "33", "eight", "1.5"])
def test_bad_environment_value_is_named(value):
    # the same rule with and without CUDA kernels: the whole value an integer in range
    code = "from shardopt import kernels; print(kernels.matmul_tuning())"
    env = dict(os.environ, SHARDOPT_MATMUL_TUNING=value)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode != 0, out.stdout
    assert f"SHARDOPT_MATMUL_TUNING must be an integer in [0, 32], got '{value}'" in out.stderr


def test_cpu_products_ignore_tuning(tuning):
    tuning(8)
    x = gauss(2, 24, 40).float()
    c = gauss(2, 24, 24).float()
    before = matmul.matmul_tuning_stats()
    assert torch.equal(kernels.bmm_add(x, x.mT, c, beta=0.5), torch.baddbmm(c, x, x.mT, beta=0.5))
    assert torch.equal(kernels.symmetric_bmm_add(x, x.mT), torch.bmm(x, x.mT))
    assert matmul.matmul_tuning_stats() == before  # nothing timed for CPU products


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@CUDA_MARK
@CUDA_SKIP
def test_cuda_tuned_products_are_exact_to_rounding_and_keep_their_algorithm(tuning, dtype):
    tuning(16)
    x = gauss(3, 328, 200, seed=1)
    c = gauss(3, 328, 328, seed=2)
    xd, cd = x.to("cuda", dtype), c.to("cuda", dtype)
    c_before = cd.clone()
    timed0, _ = kernels.matmul_tuning_stats()
    first = kernels.bmm_add(xd, xd.mT, cd, alpha=0.75, beta=-1.25)
    timed1, _ = kernels.matmul_tuning_stats()
    assert timed1 > timed0  # this case's candidates were timed
    again = kernels.bmm_add(xd, xd.mT, cd, alpha=0.75, beta=-1.25)
    assert kernels.matmul_tuning_stats()[0] == timed1  # and only once
    assert torch.equal(first, again)
    assert torch.equal(cd, c_before)  # the addend is only read, also while timing
    ref = -1.25 * c_before.double().cpu() + 0.75 * torch.bmm(
        xd.double().cpu(), xd.double().cpu().mT
    )
    assert relative(first, ref) <= UNIT[dtype]
    # a symmetric product by bands: each band's case timed into scratch, the result intact
    sym = kernels.extension().cuda.symmetric_bmm(xd, xd.mT, 1.0, 3)
    assert kernels.matmul_tuning_stats()[0] > timed1
    ref_sym = torch.bmm(xd.double().cpu(), xd.double().cpu().mT)
    assert relative(sym, ref_sym) <= UNIT[dtype]
    assert torch.equal(sym, kernels.extension().cuda.symmetric_bmm(xd, xd.mT, 1.0, 3))


@CUDA_MARK
@CUDA_SKIP
def test_cuda_case_first_met_in_capture_is_timed_after(tuning):
    tuning(5)  # a setting no other test uses: every case below is new
    x = gauss(2, 264, 136, seed=3).to("cuda", torch.bfloat16)
    c = gauss(2, 264, 264, seed=4).to("cuda", torch.bfloat16)
    timed0, _ = kernels.matmul_tuning_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.bmm_add(x, x.mT, c, alpha=2.0, beta=0.5)
    assert kernels.matmul_tuning_stats()[0] == timed0  # not timed while capturing
    graph.replay()
    torch.cuda.synchronize()
    ref = 0.5 * c.double().cpu() + 2.0 * torch.bmm(x.double().cpu(), x.double().cpu().mT)
    assert relative(out, ref) <= UNIT[torch.bfloat16]
    eager = kernels.bmm_add(x, x.mT, c, alpha=2.0, beta=0.5)
    assert kernels.matmul_tuning_stats()[0] == timed0 + 1  # timed at its first eager call
    assert relative(eager, ref) <= UNIT[torch.bfloat16]
