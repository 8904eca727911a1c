"""Accelerate and the HF Trainer with DistributedFusedAdam at world 2 on gloo: gradient
accumulation 2 and clipping at 1.0 give the weights and grad norms of the same run with
torch.optim.AdamW under DDP; torch's clip_grad_norm_ routes to the optimizer or raises."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn as nn
from dist_harness import run_cases
from hf_tiny import LR, MAX_NORM, WD, Data, TinyNet, set_env, training_args

import shardopt

pytest.importorskip("accelerate", reason="accelerate not installed (pip install .[integrations])")

REL = 1e-4


def _env(rank, world):
    set_env(rank, world, 29533)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _close(a, b, what):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=REL, atol=1e-6, msg=what)


def _accelerate(use_shardopt):
    from accelerate import Accelerator

    from shardopt.integrations.accelerate import patch

    _reset_accelerate()
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = TinyNet()
    if use_shardopt:
        patch(acc)
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    loader = torch.utils.data.DataLoader(Data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) != use_shardopt
    norms = []
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(**batch)["loss"])
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).detach().clone())
            opt.step()
            opt.zero_grad()
    params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return params, torch.stack(norms)


def accelerate_matches_ddp(rank, world):
    _env(rank, world)
    ref, ref_norms = _accelerate(False)
    got, norms = _accelerate(True)
    assert len(norms) == 2 and (norms > MAX_NORM).all(), norms  # 2 steps, clipping acts
    _close(got, ref, "params")
    _close(norms, ref_norms, "grad norms")
    start = list(TinyNet().parameters())
    assert all(not torch.equal(a, b) for a, b in zip(got, start))


def _trainer(use_shardopt, out):
    import transformers

    from shardopt.integrations.transformers import Trainer

    _reset_accelerate()
    model = TinyNet()
    args = training_args(out, num_train_epochs=1, lr_scheduler_type="constant", save_strategy="no")
    if use_shardopt:
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD)
        cls = Trainer
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        cls = transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
    trainer.train()
    norms = torch.tensor([h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    return [p.detach().clone() for p in model.parameters()], norms


def trainer_matches_ddp(rank, world):
    pytest.importorskip("transformers")
    _env(rank, world)
    with tempfile.TemporaryDirectory() as out:
        ref, ref_norms = _trainer(False, out)
        got, norms = _trainer(True, out)
    assert len(norms) == 2 and (norms > MAX_NORM).all(), norms
    _close(got, ref, "params")
    _close(norms, ref_norms, "grad norms")


def torch_clip_routes(rank, world):
    model = TinyNet()
    twin = TinyNet()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=LR)
    ddp = torch.nn.parallel.DistributedDataParallel(twin)
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=0.0)
    data = Data()
    x, y = data.x[rank::world], data.y[rank::world]
    nn.functional.mse_loss(model(x)["logits"], y).backward()
    nn.functional.mse_loss(ddp(x)["logits"], y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    opt.step()
    ref.step()
    _close(list(model.parameters()), list(twin.parameters()), "params")
    # the mistakes are loud, not silent no-ops
    nn.functional.mse_loss(model(x)["logits"], y).backward()
    with pytest.raises(RuntimeError, match="of the 4 trainable params"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], MAX_NORM)
    with pytest.raises(RuntimeError, match="value clipping"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    opt.zero_grad()


def test_hf_world2():
    """Accelerate (patch) and the Trainer (shardopt.integrations.transformers.Trainer), each
    against the same run with torch.optim.AdamW under DDP; torch's clip_grad_norm_ routing."""
    cases = [torch_clip_routes, accelerate_matches_ddp]
    try:
        import transformers  # noqa: F401

        cases.append(trainer_matches_ddp)
    except ImportError:
        pass
    results = run_cases(cases, 2, timeout=300)
    errors = {k: v for k, v in results.items() if v is not None}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
