"""FusedAdam against the fp64 reference, torch.optim.Adam/AdamW, GradScaler and lr schedulers."""

import copy

import pytest
import torch
from conftest import (
    DTYPES,
    LOW_DTYPES,
    SCALER_CASES,
    SIZE_CASES,
    SMALL_SHAPES,
    Parity,
    assert_close_to,
    init_scaler,
    make_tensors,
    run_vs_reference,
    scaled_step,
    shapes_for,
    skip_unsupported,
)

from shardopt import FusedAdam, reference

STATE = ("exp_avg", "exp_avg_sq")

OPTIONS = [
    pytest.param(dict(), id="adamw-defaults"),
    pytest.param(dict(weight_decay=0.1), id="adamw-wd"),
    pytest.param(dict(adam_w_mode=False, weight_decay=0.1), id="l2-wd"),
    pytest.param(dict(adam_w_mode=False), id="l2-no-wd"),
    pytest.param(dict(bias_correction=False, weight_decay=0.05), id="no-bias-correction"),
    pytest.param(dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02), id="betas-eps"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_options_match_reference(options, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedAdam,
        reference.Adam,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        state_keys=STATE,
        **options,
    )


@pytest.mark.parametrize("size, dtype", SIZE_CASES)
def test_sizes_match_reference(size, dtype, device):
    skip_unsupported(dtype, device)
    run_vs_reference(
        FusedAdam,
        reference.Adam,
        shapes_for(size, device),
        dtype,
        device,
        steps=2 if size == "large" else 3,
        lr=1e-2,
        weight_decay=0.01,
        state_keys=STATE,
    )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_master_weights_track_reference_in_fp32(adam_w_mode, dtype, device):
    run = run_vs_reference(
        FusedAdam,
        reference.Adam,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        weight_decay=0.1,
        adam_w_mode=adam_w_mode,
        master_weights=True,
        master=True,
        state_keys=STATE,
    )
    for p in run.params:
        # the low-precision param is the master rounded in the same pass
        assert torch.equal(p, run.opt.state[p]["master_param"].to(p.dtype))


def test_master_weights_in_a_group_mixing_fp16_and_fp32_only_for_the_fp16_params():
    """tests/optimizers/test_accepted_tensors.py checks the values; here: who gets a master."""
    params = [torch.randn(3, dtype=torch.float16), torch.randn(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = FusedAdam(params, master_weights=True)
    opt.step()
    assert opt.state[params[0]]["master_param"].dtype == torch.float32
    assert "master_param" not in opt.state[params[1]]


@pytest.mark.parametrize("lr_as_tensor", [True, False])
def test_capturable_keeps_step_as_tensor_and_matches_reference(lr_as_tensor, device):
    lr = torch.tensor(1e-2, device=device) if lr_as_tensor else 1e-2
    run = Parity(
        FusedAdam,
        reference.Adam,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        weight_decay=0.1,
        capturable=True,
    )
    run.opt.param_groups[0]["lr"] = lr
    for t in range(4):
        run.step()
        run.check(state_keys=STATE)
        step = run.opt.param_groups[0]["step"]
        assert torch.is_tensor(step) and step.device == device and step.item() == t + 1


def test_capturable_with_tensor_lr_follows_in_place_changes(device):
    lr = torch.tensor(1e-2, device=device)
    run = Parity(
        FusedAdam, reference.Adam, SMALL_SHAPES, torch.float32, device, lr=lr, capturable=True
    )
    run.ref.param_groups[0]["lr"] = 1e-2
    run.step()
    lr.fill_(3e-2)
    run.ref.param_groups[0]["lr"] = 3e-2
    run.step()
    run.check(state_keys=STATE)


@pytest.mark.parametrize("dtype,device_name", SCALER_CASES)
def test_capturable_grad_scaler_skips_inf_step_and_resumes(dtype, device_name):
    device = torch.device(device_name, 0 if device_name == "cuda" else None)
    """GradScaler hands scale and found_inf to the kernel; an inf skips everything on the device."""
    master = dtype != torch.float32
    run = Parity(
        FusedAdam,
        reference.Adam,
        SMALL_SHAPES,
        dtype,
        device,
        lr=1e-2,
        weight_decay=0.1,
        capturable=True,
        master_weights=master,
    )
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    init_scaler(scaler, device)

    grads = run.grads()
    scaled_step(scaler, run.opt, run.params, grads)
    run.ref.step([g.double().cpu() for g in grads])
    run.check(master=master, state_keys=STATE)

    before = [p.clone() for p in run.params]
    state_before = {k: [run.opt.state[p][k].clone() for p in run.params] for k in STATE}
    bad = run.grads()
    bad[1][2] = float("inf")
    scaled_step(scaler, run.opt, run.params, bad)
    assert scaler.get_scale() == 2.0**9, "GradScaler did not see the inf"
    assert run.opt.param_groups[0]["step"].item() == 1, "skipped step advanced the step count"
    for i, p in enumerate(run.params):
        assert torch.equal(p, before[i]), f"param {i} changed on a skipped step"
        for k in STATE:
            assert torch.equal(run.opt.state[p][k], state_before[k][i]), f"{k} of {i} changed"

    grads = run.grads()
    scaled_step(scaler, run.opt, run.params, grads)
    run.ref.step([g.double().cpu() for g in grads])
    assert run.opt.param_groups[0]["step"].item() == 2
    run.check(master=master, state_keys=STATE)


def test_non_capturable_grad_scaler_unscales_and_skips(device):
    run = Parity(FusedAdam, reference.Adam, SMALL_SHAPES, torch.float32, device, lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8)
    init_scaler(scaler, device)
    bad = run.grads()
    bad[0][0, 0] = float("nan")
    scaled_step(scaler, run.opt, run.params, bad)
    assert run.opt.param_groups[0]["step"] == 0
    assert all(torch.equal(p, s) for p, s in zip(run.params, run.start))
    for _ in range(2):
        grads = run.grads()
        scaled_step(scaler, run.opt, run.params, grads)
        run.ref.step([g.double().cpu() for g in grads])
        run.check(state_keys=STATE)


def test_params_without_grads_are_skipped(device):
    # param 1 never has a grad; param 2 only from the third step on
    run = run_vs_reference(
        FusedAdam,
        reference.Adam,
        SMALL_SHAPES,
        torch.float32,
        device,
        lr=1e-2,
        weight_decay=0.1,
        state_keys=STATE,
        skip=lambda t, i: i == 1 or (i == 2 and t < 2),
    )
    assert run.opt.state.get(run.params[1], {}) == {}
    assert torch.equal(run.params[1], run.start[1])


def test_step_without_any_grad_is_a_noop(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    start = [p.clone() for p in params]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    assert opt.step() is None
    assert opt.param_groups[0]["step"] == 0
    assert len(opt.state) == 0
    assert all(torch.equal(p, s) for p, s in zip(params, start))


def test_param_groups_have_their_own_hyperparameters_and_steps(device):
    run_vs_reference(
        FusedAdam,
        reference.Adam,
        [SMALL_SHAPES[:2], SMALL_SHAPES[2:]],
        torch.float32,
        device,
        group_options=[
            {"lr": 2e-2, "weight_decay": 0.1},
            {"adam_w_mode": False, "betas": (0.5, 0.9)},
        ],
        skip=lambda t, i: i >= 2 and t == 0,  # group 2 starts one step later
        lr=1e-2,
        state_keys=STATE,
    )


def test_closure_loss_is_returned(device):
    p = torch.randn(4, device=device, requires_grad=True)
    opt = FusedAdam([p], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    start = p.detach().clone()
    loss = opt.step(closure)
    torch.testing.assert_close(loss, (start * start).sum())
    ref = reference.Adam([start], lr=1e-2)
    ref.step([2 * start])
    assert_close_to(p, ref.params()[0], torch.float32, "param")


# -- against torch.optim ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "adam_w_mode, torch_cls", [(False, torch.optim.Adam), (True, torch.optim.AdamW)]
)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_optim(adam_w_mode, torch_cls, weight_decay, device):
    hp = dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-7, weight_decay=weight_decay)
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    theirs = [p.clone() for p in params]
    ours_opt = FusedAdam(params, adam_w_mode=adam_w_mode, **hp)
    theirs_opt = torch_cls(theirs, **hp)
    for _ in range(5):
        for a, b in zip(params, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours_opt.step()
        theirs_opt.step()
        for a, b in zip(params, theirs):
            assert_close_to(a, b, torch.float32, "param")


# -- state dict --------------------------------------------------------------------------------


def _step_with(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def test_state_dict_loads_into_torch_adamw_and_continues_identically(device):
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    opt = FusedAdam(params, **hp)
    for _ in range(3):
        _step_with(opt, params, [torch.randn_like(p) for p in params])
    sd = opt.state_dict()
    for entry in sd["state"].values():
        assert set(entry) == {"exp_avg", "exp_avg_sq", "step"}
        assert entry["step"].item() == 3

    torch_params = [p.clone() for p in params]
    torch_opt = torch.optim.AdamW(torch_params, **hp)
    torch_opt.load_state_dict(copy.deepcopy(sd))  # as through torch.save / torch.load
    for _ in range(2):
        grads = [torch.randn_like(p) for p in params]
        _step_with(opt, params, grads)
        _step_with(torch_opt, torch_params, grads)
        for a, b in zip(params, torch_params):
            assert_close_to(a, b, torch.float32, "param")
    assert torch_opt.state[torch_params[0]]["step"].item() == 5


def test_torch_adamw_state_dict_loads_into_fused_adam(device):
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    torch_opt = torch.optim.AdamW(params, **hp)
    for _ in range(3):
        _step_with(torch_opt, params, [torch.randn_like(p) for p in params])
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, **hp)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[0]["step"] == 3
    for _ in range(2):
        grads = [torch.randn_like(p) for p in params]
        _step_with(opt, ours, grads)
        _step_with(torch_opt, params, grads)
        for a, b in zip(ours, params):
            assert_close_to(a, b, torch.float32, "param")
    # and back again
    again = torch.optim.AdamW([p.clone() for p in ours], **hp)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in STATE:
        torch.testing.assert_close(
            again.state[again.param_groups[0]["params"][0]][k],
            opt.state[ours[0]][k],
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("master_weights", [False, True])
def test_low_precision_state_keeps_fp32_through_state_dict(dtype, master_weights, device):
    params = make_tensors(SMALL_SHAPES, dtype, device)
    opt = FusedAdam(params, lr=1e-2, master_weights=master_weights)
    for _ in range(2):
        _step_with(opt, params, [torch.randn_like(p) for p in params])
    sd = opt.state_dict()
    clone = [p.clone() for p in params]
    other = FusedAdam(clone, lr=1e-2, master_weights=master_weights)
    other.load_state_dict(copy.deepcopy(sd))
    keys = STATE + (("master_param",) if master_weights else ())
    for p, q in zip(params, clone):
        for k in keys:
            assert other.state[q][k].dtype == torch.float32
            assert torch.equal(other.state[q][k], opt.state[p][k]), k
    # full-precision state means both continue bit-identically
    grads = [torch.randn_like(p) for p in params]
    _step_with(opt, params, grads)
    _step_with(other, clone, grads)
    for p, q in zip(params, clone):
        assert torch.equal(p, q)


# -- lr schedulers and zero_grad -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make_scheduler, lr_at",
    [
        (
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1),
            lambda t: 0.1 ** (t // 2),
        ),
        (
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)),
            lambda t: 1.0 / (1 + t),
        ),
    ],
    ids=["StepLR", "LambdaLR"],
)
def test_lr_scheduler_changes_the_lr_used(make_scheduler, lr_at, device):
    base = 5e-2
    run = Parity(FusedAdam, reference.Adam, SMALL_SHAPES, torch.float32, device, lr=base)
    scheduler = make_scheduler(run.opt)
    for t in range(5):
        run.ref.param_groups[0]["lr"] = base * lr_at(t)
        assert run.opt.param_groups[0]["lr"] == pytest.approx(base * lr_at(t))
        run.step()
        run.check(state_keys=STATE)
        scheduler.step()


def test_zero_grad_sets_none_by_default(device):
    params = make_tensors(SMALL_SHAPES, torch.float32, device)
    opt = FusedAdam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    keep = FusedAdam(params, set_grad_none=False)
    for p in params:
        p.grad = torch.randn_like(p)
    keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in params)
