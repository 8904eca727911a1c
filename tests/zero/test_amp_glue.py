"""The AMP glue of the ZeRO optimizers (shardopt/zero/amp.py) and torch's clip routing
(shardopt/zero/torch_clip.py): GradScaler only through its public methods (no private state, no
scan of live objects), clip_grad_norm's returned norm under a scaler, and the routing switch.
On gloo at worlds 1 and 2, against DDP + torch.optim.AdamW + torch's own GradScaler and clip."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist_harness import run_cases

# bound at import, before any optimizer exists (in the spawned ranks too): the early-import forms
from torch.nn.utils import clip_grad_norm_ as early_clip_grad_norm_
from torch.nn.utils import clip_grad_value_ as early_clip_grad_value_
from torch.nn.utils import clip_grads_with_norm_ as early_clip_grads_with_norm_
from torch.nn.utils.clip_grad import clip_grad_norm_ as early_clip_grad_norm_deep

import shardopt
from shardopt.zero import amp, torch_clip

TOL = dict(rtol=1e-5, atol=1e-6)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    return nn.functional.mse_loss(model(x), y) * 50.0  # large grads: clipping is active


def test_amp_glue_uses_only_public_grad_scaler_methods():
    """No attribute access with a leading underscore on anything but ``self`` and modules of
    shardopt, and no ``gc``: the scaler is read and told only through public methods."""
    tree = ast.parse(Path(amp.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "gc" not in imported
    private = [
        f"{ast.unparse(n)} (line {n.lineno})"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "_ops", "comm"))
    ]
    assert not private, private


def amp_clip_matches_ddp(rank, world):
    """GradScaler + scaler.unscale_ + clip (torch's AMP recipe) through torch's
    clip_grad_norm_ routing: the norms, the skipped step on an inf, the scales and the params
    equal DDP + AdamW + torch's GradScaler. The first clip is handed the scaler explicitly (the
    ``grad_scaler`` argument); amp_recipe_* cover the recipe without it."""
    model, twin = _net(), _net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, weight_decay=0.0)
    ddp = nn.parallel.DistributedDataParallel(twin)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    for step in range(5):
        poison = step == 2 and rank == world - 1  # an inf on one rank skips the step everywhere
        handle = (
            next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
            if poison
            else None
        )
        scaler.scale(_loss(model, step, rank)).backward()
        if handle is not None:
            handle.remove()
            twin_handle = next(ddp.parameters()).register_hook(
                lambda g: torch.full_like(g, float("inf"))
            )
        ref_scaler.scale(_loss(ddp, step, rank)).backward()
        if poison:
            twin_handle.remove()
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref)
        if step == 0:
            norm = opt.clip_grad_norm(1.0, grad_scaler=scaler)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        if step != 2:
            assert ref_norm > 1.0, "clipping must be active"
            torch.testing.assert_close(norm.reshape(()), ref_norm, **TOL)
        scaler.step(opt)
        ref_scaler.step(ref)
        scaler.update()
        ref_scaler.update()
        ref.zero_grad(set_to_none=True)
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale())
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    assert int(opt.param_groups[0]["step"].item()) == 4  # one skipped


def _amp_recipe(rank, world, *, offload: bool, routed: bool):
    """torch's AMP recipe with no extra argument (``scaler.unscale_(opt)``, then a clip) returns
    the unscaled norm DDP + AdamW + torch's clip returns at every step, the first included."""
    model, twin = _net(), _net()
    kw = {"offload": "cpu"} if offload else {}
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, weight_decay=0.0, **kw)
    ddp = nn.parallel.DistributedDataParallel(twin)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        scaler.scale(_loss(model, step, rank)).backward()
        ref_scaler.scale(_loss(ddp, step, rank)).backward()
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref)
        if routed:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = opt.clip_grad_norm(1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        assert ref_norm > 1.0, "clipping must be active"
        torch.testing.assert_close(norm.reshape(()), ref_norm, rtol=1e-5, atol=0)
        scaler.step(opt)
        ref_scaler.step(ref)
        scaler.update()
        ref_scaler.update()
        ref.zero_grad(set_to_none=True)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    opt.close()


def amp_recipe_opt_clip(rank, world):
    _amp_recipe(rank, world, offload=False, routed=False)


def amp_recipe_routed_clip(rank, world):
    _amp_recipe(rank, world, offload=False, routed=True)


def amp_recipe_offload_opt_clip(rank, world):
    _amp_recipe(rank, world, offload=True, routed=False)


def amp_recipe_offload_routed_clip(rank, world):
    _amp_recipe(rank, world, offload=True, routed=True)


AMP_RECIPE_CASES = [
    amp_recipe_opt_clip,
    amp_recipe_routed_clip,
    amp_recipe_offload_opt_clip,
    amp_recipe_offload_routed_clip,
]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_amp_recipe_first_step_norm(world):
    results = run_cases(AMP_RECIPE_CASES, world, timeout=300)
    errors = {k: v for k, v in results.items() if v is not None}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())


def clip_routing_switch(rank, world):
    """set_routing(False): torch's clip_grad_norm_ gets the call unchanged (no grads in .grad:
    norm 0, nothing clipped, the optimizer not armed); set_routing(True) routes again."""
    model = _net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01)
    _loss(model, 0, rank).backward()
    assert torch_clip.routing()
    try:
        torch_clip.set_routing(False)
        assert not torch_clip.routing()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert float(norm) == 0.0  # torch's own function: it sees no .grad
        assert opt.amp.max_norm is None, "the optimizer must not have been armed"
    finally:
        torch_clip.set_routing(True)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.testing.assert_close(norm.reshape(()), opt.grad_norm(), **TOL)
    assert opt.amp.max_norm == 1.0
    with pytest.raises(RuntimeError, match="value clipping"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    opt.step()
    # installed once: building another optimizer does not wrap the router; torch's function
    # objects stay in place (routing happens inside them)
    fn = torch.nn.utils.clip_grad_norm_
    shardopt.DistributedFusedAdam(_net().parameters(), lr=0.01)
    torch_clip.install()
    assert torch.nn.utils.clip_grad_norm_ is fn is early_clip_grad_norm_
    routed = torch_clip.body_cell(fn).cell_contents
    assert routed.shardopt_original is fn.__wrapped__


CLIP_FORMS = {
    "torch.nn.utils.clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_,
    "from torch.nn.utils import clip_grad_norm_ (before the optimizer)": (
        lambda: early_clip_grad_norm_
    ),
    "from torch.nn.utils.clip_grad import clip_grad_norm_ (before the optimizer)": (
        lambda: early_clip_grad_norm_deep
    ),
    "nn.utils.clip_grad_norm_": lambda: nn.utils.clip_grad_norm_,
}


def clip_every_import_form(rank, world):
    """Each import form of torch's clip_grad_norm_, also one bound before any optimizer existed,
    returns DDP's norm and clips as DDP + AdamW + torch's clip; the forms that cannot work
    (value clipping, a norm computed elsewhere) raise instead of doing nothing."""
    for form, clip in CLIP_FORMS.items():
        model, twin = _net(), _net()
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, weight_decay=0.0)
        ddp = nn.parallel.DistributedDataParallel(twin)
        ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.0)
        for step in range(2):
            _loss(model, step, rank).backward()
            _loss(ddp, step, rank).backward()
            norm = clip()(model.parameters(), 1.0)
            ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            assert ref_norm > 1.0, "clipping must be active"
            torch.testing.assert_close(
                norm.reshape(()), ref_norm, rtol=1e-5, atol=0, msg=lambda m, f=form: f"{f}: {m}"
            )
            opt.step()
            ref.step()
            ref.zero_grad(set_to_none=True)
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a, b, **TOL, msg=lambda m, f=form: f"{f}: {m}")
        opt.close()
    model = _net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01)
    _loss(model, 0, rank).backward()
    with pytest.raises(RuntimeError, match="value clipping"):
        early_clip_grad_value_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match="clip_grads_with_norm_: params held by"):
        early_clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(5.0))
    opt.zero_grad()
    opt.close()


def clip_after_close(rank, world):
    """clip_grad_norm() / grad_norm() after close() say the optimizer was closed (not that a DDP
    wrapper wrote .grad), with a backward in between and without one; torch's clip on the
    released params is torch's own again."""
    for backward in (True, False):
        model = _net()
        opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01)
        _loss(model, 0, rank).backward()
        opt.step()
        opt.close()
        if backward:
            _loss(model, 1, rank).backward()
        for call, name in (
            (functools.partial(opt.clip_grad_norm, 1.0), "clip_grad_norm"),
            (opt.grad_norm, "grad_norm"),
        ):
            with pytest.raises(RuntimeError, match=rf"{name}\(\) after close\(\)") as info:
                call()
            assert "DistributedDataParallel" not in str(info.value)
        if backward:
            grads = [p.grad.clone() for p in model.parameters()]
            expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_clip_every_import_form(world):
    results = run_cases([clip_every_import_form, clip_after_close], world, timeout=300)
    errors = {k: v for k, v in results.items() if v is not None}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())


@pytest.mark.parametrize("world", [1, 2])
def test_amp_glue(world):
    results = run_cases([amp_clip_matches_ddp, clip_routing_switch], world, timeout=300)
    errors = {k: v for k, v in results.items() if v is not None}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
