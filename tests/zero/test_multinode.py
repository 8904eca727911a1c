"""Multi-node launch on one machine, HSDP groups from the node layout, and resharded resume.

Two torchrun launchers (``launch_scripts/train/multinode.sh``: ``--nnodes 2``, one c10d rendezvous
endpoint on localhost) with 2 gloo processes each train the example with ``--hsdp`` (shard within
a "node", replicate across the two), checkpoint, and a single launcher of 3 processes without HSDP
resumes from that checkpoint. Every layout sees the same global batch of 12 sequences per
micro-batch (data.py, Note: world-size-independent batches). References: one launcher of 4
processes with ``--hsdp --shard-size 2`` (the same rank layout as the two "nodes").

- two launchers == one launcher with the same layout, bit for bit (params, and the consolidated
  optimizer state at the checkpoint the resume starts from);
- the resume at 1 x 3 == the uninterrupted run, to fp32 rounding: the same samples, summed in
  another order (per-rank means of 4 sequences over 3 ranks instead of 3 over 4), cannot be
  bitwise equal; ``TOLERANCE`` is the one test_train_example.py uses for ZeRO vs DDP;
- a worker killed mid-run is restarted by torchrun (``MAX_RESTARTS=1``) on both nodes, resumes
  from the latest checkpoint with ``--resume`` and ends bit-equal to the uninterrupted run.

Every launcher runs under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_cases

from shardopt import checkpoint
from shardopt.zero import hsdp_groups

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "launch_scripts" / "train"

STEPS, CKPT_STEP = 6, 3
GLOBAL_BATCH = 12  # sequences per micro-batch, whatever the layout
RUN = [
    "--model", "tiny", "--block-size", "32", "--grad-accum", "2", "--steps", str(STEPS),
    "--warmup", "2", "--clip", "0.5", "--eval-interval", "3", "--eval-iters", "1",
    "--log-interval", "1", "--device", "cpu", "--no-progress", "--threads", "1",
]  # fmt: skip
TOLERANCE = dict(rtol=1.3e-6, atol=1e-5)
TIMEOUT_S = 240  # per launcher


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(cmds: list[tuple[list[str], dict[str, str]]], logs: Path) -> list[str]:
    """Starts every launcher at once (each in its own session), waits for all under the timeout;
    returns their outputs. A launcher still running at the timeout is killed with its workers."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (cmd, extra_env) in enumerate(cmds):
        out = open(logs / f"launcher{i}.log", "w+")  # closed below
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=dict(_env(), **extra_env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        procs.append((proc, out))
    outputs, failed = [], []
    for proc, out in procs:
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # this launcher's session: it and its workers
            proc.wait()
            failed.append(f"{proc.args} timed out after {TIMEOUT_S} s")
        out.seek(0)
        outputs.append(out.read())
        out.close()
        if proc.returncode != 0 and not failed:
            failed.append(f"{proc.args} exited with {proc.returncode}")
    assert not failed, "\n".join(failed) + "".join(f"\n--- launcher\n{o[-4000:]}" for o in outputs)
    return outputs


def _standalone(nproc: int, out: Path, *flags: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), str(SCRIPTS / "train_gpt.py"), *RUN, "--out-dir", str(out / "out"), *flags,
    ]  # fmt: skip
    return _launch([(cmd, {})], out / "logs")[0]


def _two_nodes(out: Path, *flags: str, max_restarts: int = 0) -> list[str]:
    """launch_scripts/train/multinode.sh twice: NNODES=2, NODE_RANK 0 and 1, 2 processes each."""
    port, run_id = _free_port(), f"test{os.getpid()}"
    args = [*RUN, "--out-dir", str(out / "out"), *flags]
    cmds = [
        (
            ["bash", str(SCRIPTS / "multinode.sh"), *args],
            dict(
                NNODES="2",
                NODE_RANK=str(node),
                NPROC_PER_NODE="2",
                MASTER_ADDR="localhost",
                MASTER_PORT=str(port),
                RDZV_ID=run_id,
                MAX_RESTARTS=str(max_restarts),
            ),
        )  # fmt: skip
        for node in (0, 1)
    ]
    return _launch(cmds, out / "logs")


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "out" / "final_model.pt", weights_only=True)


def _log(out: Path) -> dict:
    return json.loads((out / "out" / "log.json").read_text())


def _assert_equal(got, want, what: str) -> None:
    """Bitwise equality of two nested state dicts."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _assert_equal(got[k], want[k], f"{what}[{k!r}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{what}: max |diff| {(got - want).abs().max()}"
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{what}[{i}]")
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _diff_report(got: dict, want: dict) -> str:
    """Max |got - want| and the largest share of the tolerance any element uses."""
    rtol, atol = TOLERANCE["rtol"], TOLERANCE["atol"]
    diff = max(float((got[k] - w).abs().max()) for k, w in want.items())
    share = max(
        float(((got[k] - w).abs() / (atol + rtol * w.abs())).max()) for k, w in want.items()
    )
    return f"max |diff| {diff:.3g}, {share:.0%} of the tolerance"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The reference, the two-node run and the resume at 1 x 3 (out folders)."""
    root = tmp_path_factory.mktemp("multinode")
    ckpt = ["--ckpt-interval", str(CKPT_STEP)]
    one = root / "one_launcher_4"
    _standalone(
        4, one, "--batch-size", "3", "--hsdp", "--shard-size", "2", "--ckpt-dir", str(one / "ckpt"),
        *ckpt,
    )  # fmt: skip
    two = root / "two_nodes_2x2"
    _two_nodes(two, "--batch-size", "3", "--hsdp", "--ckpt-dir", str(two / "ckpt"), *ckpt)
    resumed = root / "resumed_1x3"
    start = two / "ckpt" / f"step_{CKPT_STEP:06d}"
    _standalone(3, resumed, "--batch-size", "4", "--resume", str(start))
    return {"one": one, "two": two, "resumed": resumed}


def test_two_nodes_hsdp_layout(runs):
    layout = _log(runs["two"])["layout"]
    assert layout == {"nodes": 2, "processes_per_node": 2, "shard_size": 2, "replicas": 2}
    meta = json.loads(
        (runs["two"] / "ckpt" / "step_000003" / "shards" / "metadata.json").read_text()
    )
    assert meta["world_size"] == 2  # saved at the HSDP layout: one replica's 2 shards


def test_two_nodes_equal_one_launcher(runs):
    _assert_equal(_weights(runs["two"]), _weights(runs["one"]), "final params")
    step = f"step_{CKPT_STEP:06d}"
    two = checkpoint.consolidated_state_dict(runs["two"] / "ckpt" / step / "shards")
    one = checkpoint.consolidated_state_dict(runs["one"] / "ckpt" / step / "shards")
    _assert_equal(two, one, f"{step} (optimizer state, model)")


def test_resume_at_1x3_matches_uninterrupted(runs):
    log = _log(runs["resumed"])
    assert log["world_size"] == 3 and log["layout"]["replicas"] == 1
    assert log["resumed_from"].endswith(f"step_{CKPT_STEP:06d}")
    assert log["tokens_per_step"] == _log(runs["one"])["tokens_per_step"]
    got, want = _weights(runs["resumed"]), _weights(runs["one"])
    torch.testing.assert_close(got, want, **TOLERANCE)
    print(f"\nresumed at 1x3 vs uninterrupted: {_diff_report(got, want)}")
    losses = {r["step"]: r["loss"] for r in log["history"]["train"]}
    want_losses = {r["step"]: r["loss"] for r in _log(runs["one"])["history"]["train"]}
    assert losses.keys() == want_losses.keys()
    for step, loss in want_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), step


def test_worker_failure_restarts_and_resumes(runs, tmp_path):
    """Rank 3 dies before step 3; torchrun restarts both nodes' workers, which resume from
    step_000002 (the latest complete checkpoint) and finish bit-equal to the uninterrupted run."""
    outputs = _two_nodes(
        tmp_path, "--batch-size", "3", "--hsdp", "--ckpt-dir", str(tmp_path / "ckpt"),
        "--ckpt-interval", "2", "--resume", "--fail-at-step", "3", max_restarts=1,
    )  # fmt: skip
    both = "\n".join(outputs)
    assert "simulated failure before step 3" in both
    assert "resumed from" in both and "step_000002 at step 2" in both
    log = _log(tmp_path)
    assert log["resumed_from"].endswith("step_000002")
    _assert_equal(_weights(tmp_path), _weights(runs["one"]), "final params after the restart")


# -- hsdp_groups at world 4 (gloo) ----------------------------------------------------------------


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _expect_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def groups_from_local_world_size(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        shard, replica = hsdp_groups()
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]
    assert _ranks(shard) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert _ranks(replica) == [rank % 2, rank % 2 + 2]
    # the groups work: sum of ranks over the shard group, then over the replica group
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=shard)
    assert t.item() == (0 + 1 if rank < 2 else 2 + 3)
    dist.all_reduce(t, group=replica)
    assert t.item() == 6


def groups_explicit_sizes(rank, world):
    shard, replica = hsdp_groups(1)
    assert _ranks(shard) == [rank] and _ranks(replica) == [0, 1, 2, 3]
    shard, replica = hsdp_groups(world)
    assert _ranks(shard) == [0, 1, 2, 3] and replica is None
    groups = hsdp_groups(2)
    assert _ranks(groups.process_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert groups._asdict().keys() == {"process_group", "redundant_process_group"}


def groups_bad_layouts_raise_on_every_rank(rank, world):
    _expect_value_error(lambda: hsdp_groups(3), "shard_size 3 does not divide the world size 4")
    _expect_value_error(lambda: hsdp_groups(8), "does not divide")
    # no LOCAL_WORLD_SIZE (not under torchrun): every rank raises, none hangs
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    _expect_value_error(lambda: hsdp_groups(), "LOCAL_WORLD_SIZE")
    # ranks disagreeing (nodes of 1 and 3 processes, say) raise together
    _expect_value_error(lambda: hsdp_groups(1 if rank == 0 else 2), "disagree on the shard size")
    # torchrun's node ranks not matching the blocks: a shard group would span two nodes
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["GROUP_RANK"] = str(rank % 2)
    try:
        _expect_value_error(lambda: hsdp_groups(), "span two nodes")
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]
    with pytest.raises(TypeError, match="must be an int"):
        hsdp_groups(2.0)
    _expect_value_error(lambda: hsdp_groups(0), "must be >= 1")


GROUP_CASES = [
    groups_from_local_world_size,
    groups_explicit_sizes,
    groups_bad_layouts_raise_on_every_rank,
]


@pytest.fixture(scope="module")
def group_results():
    return run_cases(GROUP_CASES, 4, timeout=120.0)


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.__name__)
def test_hsdp_groups_world4(group_results, case):
    assert group_results[case.__name__] is None, group_results[case.__name__]
