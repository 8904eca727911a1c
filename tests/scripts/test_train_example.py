"""The training example (launch_scripts/train/train_gpt.py) at world size 2 on gloo.

Parity, not a falling loss: ZeRO (DistributedFusedAdam, no DDP) and ``--baseline ddp`` (DDP +
FusedAdam) must reach the same weights from the same data, and a run resumed from a mid-run
checkpoint must reach the weights of the uninterrupted run; the same for ``--optimizer muon``
(DistributedFusedMuon against DDP + FusedMuon). Each run goes through torchrun with a
tiny model for six steps (two micro-batches per step, clipping on).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "launch_scripts" / "train"
sys.path.insert(0, str(SCRIPTS))

import data  # noqa: E402
import train_gpt  # noqa: E402

STEPS, CKPT_STEP = 6, 3
TINY_RUN = [
    "--model", "tiny", "--block-size", "32", "--batch-size", "4", "--grad-accum", "2",
    "--steps", str(STEPS), "--warmup", "2", "--clip", "0.5",
    "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1",
    "--device", "cpu", "--no-progress",
]  # fmt: skip
TOLERANCE = dict(rtol=1.3e-6, atol=1e-5)


def torchrun(out_dir: Path, *flags: str) -> dict[str, torch.Tensor]:
    """Runs the example on 2 gloo ranks; returns its final model state dict."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPTS / "train_gpt.py"), *TINY_RUN, "--out-dir", str(out_dir), *flags,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "final: train loss" in proc.stdout
    return torch.load(out_dir / "final_model.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """Six-step ZeRO and DDP runs, each checkpointing at step 3: (checkpoint dir, weights)."""
    runs = {}
    for name, flags in (("zero", []), ("ddp", ["--baseline", "ddp"])):
        root = tmp_path_factory.mktemp(name)
        ckpt = root / "ckpt"
        weights = torchrun(root / "out", "--ckpt-dir", str(ckpt), "--ckpt-interval", "3", *flags)
        runs[name] = (ckpt, weights)
    return runs


def test_zero_matches_ddp(uninterrupted):
    torch.testing.assert_close(uninterrupted["zero"][1], uninterrupted["ddp"][1], **TOLERANCE)


def test_offload_matches_zero(uninterrupted, tmp_path):
    """``--offload`` (shardopt.CPUOffload, all of the shard): the same bits as without it on a
    CPU job (docs/offload.md)."""
    offloaded = torchrun(tmp_path, "--offload")
    for name, weight in uninterrupted["zero"][1].items():
        assert torch.equal(offloaded[name], weight), name


@pytest.mark.parametrize("mode", ["zero", "ddp"])
def test_resume_matches_uninterrupted(uninterrupted, tmp_path, mode):
    ckpt, expected = uninterrupted[mode]
    flags = ["--resume", str(ckpt / f"step_{CKPT_STEP:06d}")]
    resumed = torchrun(tmp_path, *flags, *(["--baseline", "ddp"] if mode == "ddp" else []))
    torch.testing.assert_close(resumed, expected, **TOLERANCE)


def test_muon_zero_is_ddp_muon_and_resumes(tmp_path):
    """``--optimizer muon``: DistributedFusedMuon (ZeRO) reaches the weights of DDP + FusedMuon
    (``--baseline ddp``) bit for bit (world 2: each average is one exact sum and a halving), and a
    run resumed at step 3 those of the uninterrupted run. Without clipping: the clip coefficient
    is a norm of partial sums in another order under ZeRO, whose last-bit differences bf16
    Newton-Schulz turns into a ~2e-3 relative difference after six steps (test_muon_zero.py holds
    the clipped step to FusedMuon's)."""
    muon = ["--optimizer", "muon", "--clip", "0"]
    ckpt = tmp_path / "ckpt"
    zero = torchrun(tmp_path / "zero", *muon, "--ckpt-dir", str(ckpt), "--ckpt-interval", "3")
    ddp = torchrun(tmp_path / "ddp", *muon, "--baseline", "ddp")
    resumed = torchrun(tmp_path / "resumed", *muon, "--resume", str(ckpt / "step_000003"))
    assert zero.keys() == ddp.keys() == resumed.keys()
    for name, weight in zero.items():
        assert torch.equal(ddp[name], weight), name
        assert torch.equal(resumed[name], weight), name


def test_global_batch_is_the_ranks_batches_concatenated():
    corpus = data.load_corpus(None)
    whole_x, whole_y = corpus.batch("train", (0, 5, 1), batch_size=6, block_size=16)
    parts = [corpus.batch("train", (0, 5, 1), 2, 16, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
    assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])


def test_synthetic_entropy_matches_the_sample():
    source = data.MarkovSource.random(**data.SYNTHETIC)
    tokens = source.sample(64, 4096, seed=1).astype(np.int64).reshape(64, 4096)
    v = source.vocab_size
    context = (tokens[:, :-2] * v + tokens[:, 1:-1]).reshape(-1)
    counts = np.bincount(context * v + tokens[:, 2:].reshape(-1), minlength=v**3).reshape(-1, v)
    probs = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    empirical = -(counts * np.log(np.where(probs > 0, probs, 1.0))).sum() / counts.sum()
    rate = source.conditional_entropies()[-1]
    assert abs(empirical - rate) < 0.01 * rate


def _write(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "must be > 0"),
        (["--lr", "-1"], "must be > 0.0"),
        (["--optimizer", "adamax"], "invalid choice"),
        (["--model", "huge"], "invalid choice"),
        (["--ckpt-interval", "5"], "--ckpt-interval needs --ckpt-dir"),
        (["--resume"], "--resume without a path needs --ckpt-dir"),
        (["--resume", "/nonexistent/step_000003"], "not a complete checkpoint folder"),
        (["--offload", "1.5"], "must be a fraction in (0, 1] or 'auto'"),
        (["--offload", "--baseline", "ddp"], "--offload offloads the ZeRO optimizer's state"),
        (["--data", "/nonexistent/corpus.txt"], "data file not found"),
        (["--data", "{empty_txt}"], "is empty"),
        (["--data", "{empty_bin}"], "is empty"),
        (["--data", "{odd_bin}"], "odd number of bytes"),
        (["--data", "{short_txt}"], "too few for --block-size"),
        (["--data", "{latin1_txt}"], "not UTF-8 text"),
    ],
)
def test_bad_flags_are_argparse_errors(tmp_path, capsys, flags, message):
    files = {
        "empty_txt": _write(tmp_path / "empty.txt", b""),
        "empty_bin": _write(tmp_path / "empty.bin", b""),
        "odd_bin": _write(tmp_path / "odd.bin", b"\x01\x00\x02"),
        "short_txt": _write(tmp_path / "short.txt", b"hello world\n"),
        "latin1_txt": _write(tmp_path / "latin1.txt", "caf\u00e9 ".encode("latin-1") * 100),
    }
    with pytest.raises(SystemExit) as exc:
        train_gpt.parse_args([f.format(**files) for f in flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_in_a_log_file_is_one_line_per_log_interval(capsys, monkeypatch):
    """Not on a terminal (a log file, a pipe), the progress is no tqdm bar redrawn into the log
    but one line every --log-interval steps (train_report.Progress)."""
    import train_report

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    progress = train_report.Progress(main=True, bar=True, total=6, initial=0)
    assert progress.bar is None
    for done in range(1, 7):
        if done % 3 == 0:
            progress.logged(done, loss=f"{1.0 / done:.4f}")
        progress.advance()
    progress.say("step 6: val loss 0.5000")
    progress.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step 3/6: loss 0.3333",
        "step 6/6: loss 0.1667",
        "step 6: val loss 0.5000",
    ]
    assert "\r" not in out + err
    quiet = train_report.Progress(main=False, bar=True, total=6, initial=0)
    quiet.logged(3, loss="1")
    assert capsys.readouterr().out == ""


def test_runs_without_the_train_extra(tmp_path, capsys, monkeypatch):
    """Without tqdm and matplotlib (the ``train`` extra) the example logs lines instead of a bar
    and writes its model and log without the plot, saying so, instead of crashing."""
    import train_report

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = train_report.Progress(main=True, bar=True, total=2, initial=0)
    assert progress.bar is None
    progress.logged(1, loss="1.0000")
    assert "tqdm is not installed" in capsys.readouterr().out
    model = torch.nn.Linear(2, 2)
    missing = train_report.save_outputs(str(tmp_path), {"history": {}}, model)
    assert missing is not None and "matplotlib is not installed" in missing
    assert (tmp_path / "final_model.pt").exists() and (tmp_path / "log.json").exists()
    assert not (tmp_path / "loss.png").exists()
