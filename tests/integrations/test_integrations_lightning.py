"""Lightning's ShardoptStrategy at world 2 on gloo, launched by torchrun (Lightning sees torchrun's
environment, sets up the process group itself and spawns nothing). With accumulate_grad_batches=2
and gradient_clip_val=1.0, DistributedFusedAdam gives the weights, grad norms and sync_dist loss
of the same run with strategy="ddp" and torch.optim.AdamW, in fp32 and under "16-mixed" (fp16
autocast and a GradScaler, on CPU); the micro-batches before the last run in no_sync(); manual
optimization through LightningOptimizer (toggle_model, clip_gradients, step, zero_grad) gives the
automatic run's weights; trainer.save_checkpoint after one epoch + a new Trainer with ckpt_path
ends where the uninterrupted run did, and the checkpoint resumes DDP + AdamW too; a second fit of
the same module closes the first fit's optimizer; the docs/integrations.md example runs; misuse
raises.

This file is also the torchrun script: ``torchrun --nproc-per-node 2 <this file> <out dir>``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

LR, WD, MAX_NORM = 1e-2, 0.1, 1.0
REL = 1e-4
ROOT = Path(__file__).resolve().parents[2]
DOC_MARK = "<!-- tests/integrations/test_integrations_lightning.py runs the next block -->"


# -- the torchrun side ---------------------------------------------------------------------------


def _data():
    """16 samples; targets large enough that the grad norm exceeds MAX_NORM (clipping acts)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g)
    return torch.utils.data.TensorDataset(x, 10 * torch.randn(16, 3, generator=g))


def _module_class():
    import lightning.pytorch as pl
    from torch.nn.parallel import DistributedDataParallel

    import shardopt

    class Tiny(pl.LightningModule):
        def __init__(self, use_shardopt: bool, manual: bool = False):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(6, 16)
            self.b = nn.Linear(16, 3)
            self.use_shardopt = use_shardopt
            self.automatic_optimization = not manual
            self.norms: list[torch.Tensor] = []
            self.synced: list[bool] = []  # per micro-batch: did its backward sync the grads?
            self.kept: list = []  # optimizers kept alive by the module (self.opt = ... style)
            self.at_start = None  # with record_start: (params, optimizer state) at fit start
            self.record_start = False

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("loss", loss, sync_dist=True, on_step=True)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()  # a LightningOptimizer
            last = (batch_idx + 1) % 2 == 0
            with opt.toggle_model(sync_grad=last):
                self.manual_backward(loss / 2)
            if last:
                self.clip_gradients(opt, gradient_clip_val=MAX_NORM, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
            return None

        def on_train_start(self):
            # the LightningOptimizer wrappers Lightning made and dropped in setup are collected:
            # the optimizer's grad hooks must survive them
            gc.collect()
            wrapped = isinstance(self.trainer.strategy.model, DistributedDataParallel)
            assert wrapped != self.use_shardopt, "ShardoptStrategy wrapped the model in DDP"
            if self.record_start:  # after ckpt_path was loaded; state_dict() on every rank
                params = [p.detach().clone() for p in self.parameters()]
                self.at_start = (params, self.optimizers().optimizer.state_dict())

        def on_after_backward(self):
            if self.use_shardopt:  # False inside the strategy's block_backward_sync
                (opt,) = self.trainer.strategy.shardopt_optimizers()
                self.synced.append(opt.grad_sync.enabled)

        def on_before_optimizer_step(self, optimizer):
            if self.use_shardopt:
                norm = optimizer.grad_norm()  # p.grad is None: the grads are sharded
                scaler = getattr(self.trainer.precision_plugin, "scaler", None)
                if scaler is not None:  # grad_norm() is of the loss-scaled grads
                    norm = norm / scaler.get_scale()
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
            self.norms.append(norm.detach().clone())

        def configure_optimizers(self):
            if self.use_shardopt:
                opt = shardopt.DistributedFusedAdam(self.parameters(), lr=LR, weight_decay=WD)
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
            self.kept.append(opt)
            return opt

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_data(), batch_size=2)

    return Tiny


def _fit(use_shardopt, epochs, manual=False, ckpt_path=None, save=None, model=None, **args):
    import lightning.pytorch as pl

    from shardopt.integrations.lightning import ShardoptStrategy

    if model is None:
        model = _module_class()(use_shardopt, manual)
    defaults = dict(
        accelerator="cpu",
        devices=2,
        strategy=ShardoptStrategy() if use_shardopt else "ddp",
        max_epochs=epochs,  # 4 micro-batches per rank and epoch: 2 steps
        accumulate_grad_batches=1 if manual else 2,
        gradient_clip_val=None if manual else MAX_NORM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer = pl.Trainer(**{**defaults, **args})
    trainer.fit(model, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)  # on every rank: optimizer.state_dict() is collective
    params = [p.detach().clone() for p in model.parameters()]
    if use_shardopt:
        assert model.synced == [False, True] * (len(model.synced) // 2), model.synced
    return params, torch.stack(model.norms), trainer.callback_metrics["loss"].clone(), trainer


def _close(a, b, what, rtol=REL, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


_RUNS: dict = {}


def matches_ddp(out):
    """ShardoptStrategy + DistributedFusedAdam == strategy="ddp" + AdamW (accumulation 2,
    clipping 1.0, 2 epochs of 2 steps)."""
    ref, ref_norms, ref_loss, _ = _fit(False, 2)
    got, norms, loss, trainer = _fit(True, 2)
    _RUNS["uninterrupted"] = (got, norms)
    assert trainer.global_step == 4
    assert len(norms) == 4 and (norms > MAX_NORM).all(), norms  # clipping acts
    _close(got, ref, "params")
    _close(norms, ref_norms, "grad norms")
    _close([loss], [ref_loss], "sync_dist loss")
    start = list(_module_class()(True).parameters())
    assert all(not torch.equal(a, b) for a, b in zip(got, start)), "weights did not change"


def amp_fp16_matches_ddp(out):
    """precision "16-mixed" (fp16 autocast on CPU, a GradScaler): Lightning's plugin refuses to
    clip optimizers that unscale in step(); the strategy routes clipping to clip_grad_norm with
    the scaler, and GradScaler.step hands itself to step(grad_scaler=...)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))

    ref, ref_norms, _, ref_trainer = _fit(False, 2, plugins=[plugin()])
    got, norms, _, trainer = _fit(True, 2, plugins=[plugin()])
    assert len(norms) == 4 and (norms > MAX_NORM).all(), norms
    _close(got, ref, "params (16-mixed)")
    _close(norms, ref_norms, "grad norms (16-mixed)")
    scales = [t.precision_plugin.scaler.get_scale() for t in (trainer, ref_trainer)]
    assert scales[0] == scales[1], scales


def manual_optimization(out):
    """automatic_optimization=False through the LightningOptimizer wrapper: toggle_model(
    sync_grad=False) accumulates, self.clip_gradients clips, opt.step/zero_grad."""
    got, norms, _, _ = _fit(True, 2, manual=True)
    ref, ref_norms = _RUNS["uninterrupted"]
    _close(got, ref, "params (manual)", rtol=1e-6, atol=1e-7)
    _close(norms, ref_norms, "grad norms (manual)", rtol=1e-6, atol=1e-7)


def checkpoint_resume(out):
    """fit 1 epoch, trainer.save_checkpoint; a new Trainer fits the 2nd epoch from it and ends
    where the uninterrupted run ended; the checkpoint also resumes strategy="ddp" + AdamW."""
    path = os.path.join(out, "epoch1.ckpt")
    _fit(True, 1, save=path)
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["optimizer_states"][0]["state"]
    shapes = [tuple(p.shape) for p in _module_class()(True).parameters()]
    assert [tuple(state[i]["exp_avg"].shape) for i in range(4)] == shapes, state.keys()
    assert all(float(state[i]["step"]) == 2 for i in range(4))
    ref, ref_norms = _RUNS["uninterrupted"]
    got, norms, _, trainer = _fit(True, 2, ckpt_path=path)
    assert trainer.global_step == 4
    _close(got, ref, "params (resumed)", rtol=1e-6, atol=1e-7)
    _close(norms, ref_norms[2:], "grad norms (resumed)", rtol=1e-6, atol=1e-7)
    got, norms, _, _ = _fit(False, 2, ckpt_path=path)  # torch.optim.AdamW loads it
    _close(got, ref, "params (resumed by DDP + AdamW)")
    _close(norms, ref_norms[2:], "grad norms (resumed by DDP + AdamW)")


def checkpoint_callback_resume(out):
    """ModelCheckpoint (every epoch, every rank calls it) while fitting 2 epochs; a new Trainer
    resumes from the epoch-1 file: the weights and optimizer state it starts from are the saved
    ones exactly, and it ends where the uninterrupted run ended."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = os.path.join(out, "callback")
    every_epoch = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)
    got, _, _, _ = _fit(True, 2, enable_checkpointing=True, callbacks=[every_epoch])
    ref, ref_norms = _RUNS["uninterrupted"]
    _close(got, ref, "params (with ModelCheckpoint)", rtol=0, atol=0)
    path = os.path.join(folder, "epoch=0.ckpt")
    ckpt = torch.load(path, weights_only=False)
    model = _module_class()(True)
    model.record_start = True
    got, norms, _, trainer = _fit(True, 2, ckpt_path=path, model=model)
    assert trainer.global_step == 4
    params, state = model.at_start
    _close(params, list(ckpt["state_dict"].values()), "weights read back", rtol=0, atol=0)
    saved = ckpt["optimizer_states"][0]
    assert state["param_groups"] == saved["param_groups"]
    for i, entry in saved["state"].items():
        for name, t in entry.items():
            assert torch.equal(state["state"][i][name], t), f"optimizer state {i} {name}"
    _close(got, ref, "params (resumed from ModelCheckpoint)", rtol=1e-5, atol=1e-7)
    _close(norms, ref_norms[2:], "grad norms (resumed from ModelCheckpoint)", rtol=1e-5, atol=1e-7)


def refit_same_module(out):
    """Two fits of one module that keeps its optimizers alive: the first fit's optimizer still
    has its grad hooks on the params; the strategy closes it at the second setup, and the two
    fits give what two fits under DDP + AdamW give."""

    def two_fits(use_shardopt):
        model = _module_class()(use_shardopt)
        for _ in range(2):
            params, _, _, _ = _fit(use_shardopt, 1, model=model)
        return params, torch.stack(model.norms), model.kept

    ref, ref_norms, _ = two_fits(False)
    got, norms, kept = two_fits(True)
    assert len(kept) == 2 and kept[0].closed and not kept[1].closed
    _close(got, ref, "params (two fits)")
    _close(norms, ref_norms, "grad norms (two fits)")


def docs_example(out):
    """The Lightning example of docs/integrations.md, as written."""
    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    m = re.search(re.escape(DOC_MARK) + r"\s*```text\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert m, f"no block after {DOC_MARK!r} in docs/integrations.md"
    cwd = os.getcwd()
    os.chdir(out)
    try:
        exec(compile(m.group(1), "docs/integrations.md", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)


def misuse(out):
    """torch.optim with ShardoptStrategy (grads would not be synced), value clipping and the
    optimizer of an earlier fit returned again raise."""
    import lightning.pytorch as pl

    from shardopt.integrations.lightning import ShardoptStrategy

    model = _module_class()(False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardoptStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="4 of the model's 4 trainable params"):
        trainer.fit(model)
    with pytest.raises(RuntimeError, match="clips by the L2 norm only"):
        _fit(True, 1, gradient_clip_algorithm="value")
    model = _module_class()(True)
    _fit(True, 1, model=model)
    model.configure_optimizers = lambda: model.kept[0]  # closed when the next fit starts
    with pytest.raises(RuntimeError, match="optimizer of an earlier fit"):
        _fit(True, 1, model=model)


CASES = [
    matches_ddp,
    amp_fp16_matches_ddp,
    manual_optimization,
    checkpoint_resume,
    checkpoint_callback_resume,
    refit_same_module,
    docs_example,
    misuse,
]


def _main(out: str) -> None:
    import logging
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {}
    for case in CASES:
        start = time.perf_counter()
        try:
            case(out)
            results[case.__name__] = None
        except Exception:  # reported to pytest, which fails the case
            results[case.__name__] = traceback.format_exc()
        if dist.is_initialized():
            dist.barrier()
        print(f"{case.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
    rank = os.environ["RANK"]
    Path(out, f"results-rank{rank}.json").write_text(json.dumps(results))


# -- the pytest side -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("lightning", reason="lightning not installed (pip install .[integrations])")
    import shardopt

    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ)
    src = str(Path(shardopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, __file__, str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a hang is killed with its workers
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun hung for 300 s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{log[-6000:]}"
    merged: dict = {}
    for rank in (0, 1):
        for name, err in json.loads((out / f"results-rank{rank}.json").read_text()).items():
            if merged.get(name) is None:
                merged[name] = None if err is None else f"rank {rank}:\n{err}"
    return merged


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_lightning_world2(results, case):
    assert results[case.__name__] is None, results[case.__name__]


if __name__ == "__main__":
    _main(sys.argv[1])
