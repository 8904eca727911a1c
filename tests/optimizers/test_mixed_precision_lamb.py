"""FusedMixedPrecisionLamb: device lr/step, fp32 masters of reduced-precision params, GradScaler."""

import pytest
import torch
from conftest import (
    LOW_DTYPES,
    SCALER_CASES,
    SMALL_SHAPES,
    Parity,
    init_scaler,
    run_vs_reference,
    scaled_step,
)

from shardopt import FusedMixedPrecisionLamb, reference

STATE = ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_grad_norm=0.1),
        dict(use_nvlamb=True, weight_decay=0.0),
        dict(adam_w_mode=False),
    ],
    ids=["defaults", "clip", "nvlamb", "l2"],
)
def test_fp32_params_match_reference_with_device_lr_and_step(options, device):
    run = run_vs_reference(
        FusedMixedPrecisionLamb,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        state_keys=STATE,
        **options,
    )
    group = run.opt.param_groups[0]
    assert torch.is_tensor(group["lr"]) and group["lr"].device == device
    assert torch.is_tensor(group["step"]) and group["step"].item() == 4


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.1])
def test_reduced_precision_params_have_fp32_masters(dtype, max_grad_norm, device):
    run = run_vs_reference(
        FusedMixedPrecisionLamb,
        reference.LAMB,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        reduced_precision_dtype=dtype,
        max_grad_norm=max_grad_norm,
        master=True,
        state_keys=STATE,
    )
    for p in run.params:
        assert torch.equal(p, run.opt.state[p]["master_param"].to(dtype))


def test_initial_step_argument_sets_the_bias_correction(device):
    run = Parity(
        FusedMixedPrecisionLamb,
        reference.LAMB,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        step=10,
    )
    run.ref.param_groups[0]["step"] = 10
    for _ in range(2):
        run.step()
        run.check(state_keys=STATE)
    assert run.opt.param_groups[0]["step"].item() == 12


@pytest.mark.parametrize(
    "dtype,device_name", [c for c in SCALER_CASES if c.values[0] != torch.float32]
)
def test_grad_scaler_inf_skips_the_step_without_advancing(dtype, device_name):
    device = torch.device(device_name, 0 if device_name == "cuda" else None)
    run = Parity(
        FusedMixedPrecisionLamb,
        reference.LAMB,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        reduced_precision_dtype=dtype,
        max_grad_norm=0.5,
    )
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    init_scaler(scaler, device)
    grads = run.grads()
    scaled_step(scaler, run.opt, run.params, grads)
    run.ref.step([g.double().cpu() for g in grads])
    run.check(master=True, state_keys=STATE)

    keys = STATE + ("master_param",)
    before = [p.clone() for p in run.params]
    state_before = [{k: run.opt.state[p][k].clone() for k in keys} for p in run.params]
    bad = run.grads()
    bad[0][1, 1] = float("inf")
    scaled_step(scaler, run.opt, run.params, bad)
    assert scaler.get_scale() == 2.0**9
    assert run.opt.param_groups[0]["step"].item() == 1, "a skipped step advanced the step"
    for i, p in enumerate(run.params):
        assert torch.equal(p, before[i])
        for k in keys:
            assert torch.equal(run.opt.state[p][k], state_before[i][k]), f"{k} of {i} changed"

    grads = run.grads()
    scaled_step(scaler, run.opt, run.params, grads)
    run.ref.step([g.double().cpu() for g in grads])
    assert run.opt.param_groups[0]["step"].item() == 2
    run.check(master=True, state_keys=STATE)
