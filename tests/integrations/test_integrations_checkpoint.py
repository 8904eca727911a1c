"""Checkpoints through every stack at world 2 on gloo, with DistributedFusedAdam holding the
params: HF Trainer's own save/resume (save_strategy="steps", resume_from_checkpoint), with and
without CPU offload (shardopt's Trainer, and a transformers.Trainer through patch_trainer);
Accelerate's save_state/load_state with its defaults (safetensors), with and without offload;
transformers' save_pretrained, safetensors' save_model/load_model and plain
torch.save(model.state_dict()). Each: the weights and the optimizer state read back are exactly
the saved ones, and training resumed from the checkpoint ends where the uninterrupted run ends
(1e-5). Lightning's checkpoint callback is in test_integrations_lightning.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases
from hf_tiny import LR, MAX_NORM, WD, Data, TinyNet, set_env, training_args

import shardopt

pytest.importorskip("accelerate", reason="accelerate not installed (pip install .[integrations])")
pytest.importorskip(
    "transformers", reason="transformers not installed (pip install .[integrations])"
)
pytest.importorskip("safetensors", reason="safetensors not installed (pip install .[integrations])")

RESUMED = dict(rtol=1e-5, atol=1e-7)  # resumed run against the uninterrupted one


def _env(rank, world):
    # SHARDOPT_ARRIVAL_TIMEOUT: a save on one rank fails in 10 s, not 30
    set_env(rank, world, 29534, SHARDOPT_ARRIVAL_TIMEOUT="10")


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _shared_dir(rank) -> str:
    """One temporary directory for both ranks (rank 0 makes it, the others get its name)."""
    box = [tempfile.mkdtemp(prefix="shardopt-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} [{i}]: off by {(x - y).abs().max().item():.3g}"


def _close(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **RESUMED, msg=lambda m: f"{what}: {m}")


def _same_state(a: dict, b: dict, what: str) -> None:
    """Two optimizer state dicts hold the same tensors and groups, exactly."""
    assert a["param_groups"] == b["param_groups"], what
    assert a["state"].keys() == b["state"].keys(), what
    for pid in a["state"]:
        for name, t in a["state"][pid].items():
            assert torch.equal(t, b["state"][pid][name]), f"{what}: state {pid} {name}"


# -- HF Trainer -----------------------------------------------------------------------------------


def _trainer_run(out, offload, resume_from=None):
    """4 steps (2 epochs, accumulation 2, clipping, a linear schedule) with a checkpoint every 2;
    returns the final params, the logged grad norms, and what a callback saw: the params and
    optimizer state when saving at step 2, or when the resumed run began."""
    import transformers

    from shardopt.integrations.transformers import Trainer, patch_trainer

    seen = {}

    class Watch(transformers.TrainerCallback):
        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 2:
                seen["params"], seen["state"] = _params(model), optimizer.state_dict()

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if resume_from is not None:
                seen["params"], seen["state"] = _params(model), optimizer.state_dict()

    _reset_accelerate()
    model = TinyNet()
    args = training_args(
        out, max_steps=4, lr_scheduler_type="linear", save_strategy="steps", save_steps=2
    )
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD, offload=offload)
    kw = dict(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
    if offload is None:
        trainer = Trainer(**kw, callbacks=[Watch()])
    else:  # the other way in: an existing transformers.Trainer, patched
        trainer = patch_trainer(transformers.Trainer(**kw, callbacks=[Watch()]))
    trainer.train(resume_from_checkpoint=resume_from)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    opt.close()
    return _params(model), torch.tensor(norms), seen


def _trainer_resumes(rank, world, offload):
    _env(rank, world)
    out = _shared_dir(rank)
    ref, ref_norms, saved = _trainer_run(out, offload)
    assert len(ref_norms) == 4 and (ref_norms > MAX_NORM).all(), ref_norms  # clipping acts
    ckpt = os.path.join(out, "checkpoint-2")
    assert os.path.isfile(os.path.join(ckpt, "optimizer.pt")), os.listdir(ckpt)
    written = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    _same_state(written, saved["state"], "optimizer.pt against state_dict() at step 2")
    dist.barrier()
    got, norms, loaded = _trainer_run(out, offload, resume_from=ckpt)
    _equal(loaded["params"], saved["params"], "weights read back at step 2")
    _same_state(loaded["state"], saved["state"], "optimizer state read back at step 2")
    _close(got, ref, "weights after the resumed steps 3-4")
    _close(norms[-2:], ref_norms[2:], "grad norms of the resumed steps 3-4")  # (1-2: loaded)


def trainer_resumes(rank, world):
    """Trainer's own checkpoint at step 2, a new Trainer resumed from it: the uninterrupted run."""
    _trainer_resumes(rank, world, None)


def trainer_resumes_offload(rank, world):
    """The same with offload="cpu", through patch_trainer(transformers.Trainer(...))."""
    _trainer_resumes(rank, world, "cpu")


# -- Accelerate -----------------------------------------------------------------------------------


def _accelerate_run(out, offload, steps, save_at=None, load=False):
    """``steps`` optimizer steps (accumulation 2, clipping); ``save_state(out)`` after step
    ``save_at``; with ``load``, ``load_state(out)`` first. Returns the final params and what was
    saved or loaded (params and optimizer state)."""
    from accelerate import Accelerator

    from shardopt.integrations.accelerate import patch

    _reset_accelerate()
    acc = patch(Accelerator(gradient_accumulation_steps=2, cpu=True))
    model = TinyNet()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD, offload=offload)
    loader = torch.utils.data.DataLoader(Data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen = {}
    if load:
        acc.load_state(out)  # the defaults: safetensors weights, torch.save'd optimizer
        seen["params"], seen["state"] = _params(model), opt.state_dict()
    done = 0
    while done < steps:
        for batch in loader:
            with acc.accumulate(model):
                acc.backward(model(**batch)["loss"])
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                done += 1
                if done == save_at:
                    acc.save_state(out)
                    seen["params"], seen["state"] = _params(model), opt.state_dict()
                if done == steps:
                    break
    opt.optimizer.close()
    return _params(model), seen


def _accelerate_resumes(rank, world, offload):
    _env(rank, world)
    out = _shared_dir(rank)
    ref, saved = _accelerate_run(out, offload, 4, save_at=2)
    dist.barrier()
    got, loaded = _accelerate_run(out, offload, 2, load=True)
    _equal(loaded["params"], saved["params"], "weights read back by load_state")
    _same_state(loaded["state"], saved["state"], "optimizer state read back by load_state")
    _close(got, ref, "weights after 2 more steps")


def accelerate_resumes(rank, world):
    """save_state after step 2, load_state into a new model and optimizer, 2 more steps."""
    _accelerate_resumes(rank, world, None)


def accelerate_resumes_offload(rank, world):
    """The same with offload="cpu"."""
    _accelerate_resumes(rank, world, "cpu")


# -- savers of the model alone --------------------------------------------------------------------


def _steps(model, opt, rank, first, last):
    """Optimizer steps ``first`` .. ``last - 1`` on this rank's batches of Data (clipped)."""
    data = Data()
    for step in range(first, last):
        i = (2 * step + rank) % 8
        x, y = data.x[2 * i : 2 * i + 2], data.y[2 * i : 2 * i + 2]
        nn.functional.mse_loss(model(x)["logits"], y).backward()
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _model_saver_resumes(rank, world, make, save, load):
    """2 steps, ``save(model, dir)`` (rank 0 writes) and torch.save of the optimizer state;
    ``load(dir)`` gives a new model (and the optimizer holding it, or None: a new one), the
    optimizer loads the state, 2 more steps: the weights read back are the saved ones and the
    end is the uninterrupted run's."""
    out = _shared_dir(rank)
    model = make()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    _steps(model, opt, rank, 0, 2)
    saved = _params(model)
    state = opt.state_dict()
    failure = [None]
    if rank == 0:
        try:
            save(model, out)
            torch.save(state, os.path.join(out, "optim.pt"))
        except Exception as e:  # told to every rank, so that none waits for rank 0
            failure = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(failure, src=0)
    assert failure[0] is None, f"saving on rank 0 failed: {failure[0]}"
    _steps(model, opt, rank, 2, 4)
    ref = _params(model)
    opt.close()
    model, opt = load(out)
    _equal(_params(model), saved, "weights read back")
    if opt is None:  # else loaded into a model the optimizer already held
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    opt.load_state_dict(torch.load(os.path.join(out, "optim.pt"), weights_only=True))
    _same_state(opt.state_dict(), state, "optimizer state read back")
    _steps(model, opt, rank, 2, 4)
    _close(_params(model), ref, "weights after 2 more steps")
    opt.close()


def _pretrained_class():
    import transformers

    class TinyConfig(transformers.PretrainedConfig):
        model_type = "shardopt_tiny"

    class TinyPreTrained(transformers.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            torch.manual_seed(0)
            self.a = nn.Linear(6, 16)
            self.b = nn.Linear(16, 3)
            self.post_init()

        def _init_weights(self, module):
            """Keeps the seeded nn.Linear init (the test compares against it)."""

        def forward(self, x):
            return {"logits": self.b(torch.tanh(self.a(x)))}

    return TinyConfig, TinyPreTrained


def save_pretrained_resumes(rank, world):
    """transformers' save_pretrained (safetensors) of a model whose params the optimizer holds,
    from_pretrained back."""
    config_class, model_class = _pretrained_class()

    def save(model, out):
        model.save_pretrained(out)

    def load(out):
        return model_class.from_pretrained(out), None

    _model_saver_resumes(rank, world, lambda: model_class(config_class()), save, load)


def safetensors_save_model_resumes(rank, world):
    """safetensors' save_model, and load_model into a model whose params an optimizer holds."""
    import safetensors.torch

    def save(model, out):
        safetensors.torch.save_model(model, os.path.join(out, "model.safetensors"))

    def load(out):
        model = TinyNet()
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD)
        missing, unexpected = safetensors.torch.load_model(
            model, os.path.join(out, "model.safetensors")
        )
        assert not missing and not unexpected, (missing, unexpected)
        return model, opt

    _model_saver_resumes(rank, world, TinyNet, save, load)


def torch_save_resumes(rank, world):
    """Plain torch.save(model.state_dict()) and model.load_state_dict(torch.load(...))."""

    def save(model, out):
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))

    def load(out):
        model = TinyNet()
        model.load_state_dict(torch.load(os.path.join(out, "model.pt"), weights_only=True))
        return model, None

    _model_saver_resumes(rank, world, TinyNet, save, load)


CASES = [
    trainer_resumes,
    trainer_resumes_offload,
    accelerate_resumes,
    accelerate_resumes_offload,
    save_pretrained_resumes,
    safetensors_save_model_resumes,
    torch_save_resumes,
]


@pytest.fixture(scope="module")
def results():
    # a rank left waiting in a collective (a save that failed on rank 0) fails in 60 s
    return run_cases(CASES, 2, timeout=400, pg_timeout=60, report_hangs=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_checkpoint_world2(results, case):
    assert results[case.__name__] is None, results[case.__name__]
