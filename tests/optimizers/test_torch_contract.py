"""The torch.optim contract of the six single-process classes: ``add_param_group``,
state-dict hooks, hyperparameter validation with torch's messages, torch.optim's common flags
(``foreach``, ``fused``, ``maximize``, ``differentiable``), ``load_state_dict`` copying tensor
hyperparameters, FusedMixedPrecisionLamb's per-group lr, and fp32 masters that follow writes into
their params (FusedAdam/FusedLAMB with master_weights, FusedMixedPrecisionLamb)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardopt import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

FACTORIES = [
    pytest.param(lambda ps, **kw: FusedAdam(ps, **{"lr": 1e-2, **kw}), id="FusedAdam"),
    pytest.param(lambda ps, **kw: FusedLAMB(ps, **{"lr": 1e-2, **kw}), id="FusedLAMB"),
    pytest.param(lambda ps, **kw: FusedNovoGrad(ps, **{"lr": 1e-2, **kw}), id="FusedNovoGrad"),
    pytest.param(
        lambda ps, **kw: FusedSGD(ps, **{"lr": 1e-2, "momentum": 0.9, **kw}), id="FusedSGD"
    ),
    pytest.param(lambda ps, **kw: FusedAdagrad(ps, **{"lr": 1e-2, **kw}), id="FusedAdagrad"),
    pytest.param(
        lambda ps, **kw: FusedMixedPrecisionLamb(ps, **{"lr": 1e-2, **kw}),
        id="FusedMixedPrecisionLamb",
    ),
]
CLASSES = [FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD, FusedAdagrad, FusedMixedPrecisionLamb]
WITH_BETAS = [FusedAdam, FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb]


def _params(*shapes, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]


def _set_grads(params, step, sign=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (sign * torch.randn(p.shape, generator=gen)).to(p.device)


def _group_lr(group) -> float:
    lr = group["lr"]
    return float(lr.item() if torch.is_tensor(lr) else lr)


# -- add_param_group --------------------------------------------------------------------------


@pytest.mark.parametrize("make", FACTORIES)
def test_add_param_group_matches_a_group_given_at_construction(make):
    """Regression: a group added after construction had no ``step`` (KeyError at the next step).
    Now its missing hyperparameters come from the defaults, its state is created at its first
    update, and it trains exactly as the same group given to the constructor without grads."""
    added, given = _params((4, 3), (5,)), _params((4, 3), (5,))
    opt = make([added[0]])
    ref = make([{"params": [given[0]]}, {"params": [given[1]], "weight_decay": 0.05}])
    for step in range(2):
        _set_grads(added[:1], step)
        _set_grads(given[:1], step)
        opt.step()
        ref.step()
    opt.add_param_group({"params": [added[1]], "weight_decay": 0.05})
    assert added[1] not in opt.state or not opt.state[added[1]]  # created lazily
    new, want = opt.param_groups[1], ref.param_groups[1]
    assert set(new) == set(want)
    for key in new:
        if key not in ("params", "lr", "step", "exp_avg_sq"):
            assert new[key] == want[key], key
    assert _group_lr(new) == _group_lr(want)
    for step in range(2, 5):
        _set_grads(added, step)
        _set_grads(given, step)
        opt.step()
        ref.step()
    for a, g in zip(added, given, strict=True):
        torch.testing.assert_close(a, g, rtol=0, atol=0)
    assert set(opt.state[added[1]]) == set(ref.state[given[1]])


def test_add_param_group_matches_torch_adamw():
    ours, theirs = _params((4, 3), (5,)), _params((4, 3), (5,))
    opt = FusedAdam([ours[0]], lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW([theirs[0]], lr=1e-2, weight_decay=0.01)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": [ours[1]], "lr": 0.05})
            ref.add_param_group({"params": [theirs[1]], "lr": 0.05})
            assert opt.param_groups[1]["lr"] == 0.05
            assert opt.param_groups[1]["weight_decay"] == 0.01
        n = 1 if step < 2 else 2
        _set_grads(ours[:n], step)
        _set_grads(theirs[:n], step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-6)


def test_add_param_group_checks_dtypes_with_the_global_index():
    opt = FusedAdam(_params((2,), (3,)))
    with pytest.raises(TypeError, match=r"param 3 has dtype torch.int64"):
        opt.add_param_group({"params": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]})


def test_mixed_precision_lamb_add_param_group_gets_a_device_lr_and_step():
    ps = _params((3,), (2,))
    opt = FusedMixedPrecisionLamb([ps[0]], lr=1e-2, step=5)
    opt.add_param_group({"params": [ps[1]], "lr": 0.5})
    group = opt.param_groups[1]
    assert torch.is_tensor(group["lr"]) and group["lr"].dtype == torch.float32
    assert group["lr"].item() == 0.5
    assert opt.param_groups[0]["step"].item() == 5 and group["step"].item() == 0
    opt.add_param_group({"params": [torch.zeros(2), torch.zeros(2, dtype=torch.float16)]})
    assert len(opt.param_groups) == 3  # a group may mix dtypes, as Apex's


def test_device_scalar_passes_a_kernel_scalar_through_and_shapes_the_rest():
    """step_args.device_scalar: a 1-element fp32 tensor on the device is returned as is (the
    offloaded update's step calls no torch op), a 0-dim or other-dtype scalar is shaped (1,)
    fp32, and a tensor of several elements is refused."""
    from shardopt.algorithms.step_args import device_scalar, step_args

    cpu = torch.device("cpu")
    t = torch.full((1,), 3.0)
    assert device_scalar(t, cpu) is t and step_args(t, cpu)["step_t"] is t
    for other in (torch.tensor(3.0), torch.tensor([3], dtype=torch.int64)):
        got = device_scalar(other, cpu)
        assert got is not other and got.shape == (1,) and got.dtype == torch.float32
        assert got.item() == 3.0
    with pytest.raises(RuntimeError):
        device_scalar(torch.ones(3), cpu)


# -- state-dict hooks -------------------------------------------------------------------------


def _hooked(opt, log):
    """Registers one hook of each kind; they log what they see and edit what they may."""

    def sd_post(o, sd):
        steps = all("step" in s for s in sd["state"].values())
        log.append(("state_dict post", o is opt, sorted(sd), steps))
        return {**sd, "extra": "from the post-hook"}

    def load_pre(o, sd):
        log.append(("load pre", o is opt, sd.get("extra")))
        groups = [{**g, "lr": 0.25} for g in sd["param_groups"]]
        return {"state": sd["state"], "param_groups": groups}

    handles = [
        opt.register_state_dict_pre_hook(lambda o: log.append(("state_dict pre", o is opt))),
        opt.register_state_dict_post_hook(sd_post),
        opt.register_load_state_dict_pre_hook(load_pre),
        opt.register_load_state_dict_post_hook(
            lambda o: log.append(("load post", o is opt, _group_lr(o.param_groups[0])))
        ),
    ]
    return handles


def _hook_run(opt, params):
    log = []
    handles = _hooked(opt, log)
    _set_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    log.append(("returned", sd.get("extra")))
    opt.load_state_dict(sd)
    log.append(("loaded lr", _group_lr(opt.param_groups[0])))
    for h in handles:
        h.remove()
    opt.state_dict()
    opt.load_state_dict(sd)  # removed hooks no longer run
    return log


@pytest.mark.parametrize("make", FACTORIES)
def test_state_dict_hooks_fire_as_in_torch_adamw(make):
    """Regression: the load hooks never ran (load_state_dict is overridden), and the
    state_dict post-hooks saw the dict before the per-param steps were added."""
    theirs, ours = _params((3, 2)), _params((3, 2))
    want = _hook_run(torch.optim.AdamW(theirs, lr=1e-2), theirs)
    assert want == [
        ("state_dict pre", True),
        ("state_dict post", True, ["param_groups", "state"], True),
        ("returned", "from the post-hook"),
        ("load pre", True, "from the post-hook"),
        ("load post", True, 0.25),
        ("loaded lr", 0.25),
    ]
    assert _hook_run(make(ours), ours) == want


# -- hyperparameter validation ----------------------------------------------------------------

NAN = float("nan")
BAD_VALUES = (
    [(cls, dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0") for cls in CLASSES]
    + [(cls, dict(lr=NAN), ValueError, "Invalid learning rate: nan") for cls in CLASSES]
    + [
        (cls, dict(weight_decay=-0.1), ValueError, "Invalid weight_decay value: -0.1")
        for cls in CLASSES
    ]
    + [
        (cls, dict(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08")
        for cls in WITH_BETAS + [FusedAdagrad]
    ]
    + [
        (cls, dict(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0: 1.0")
        for cls in WITH_BETAS
    ]
    + [
        (cls, dict(betas=(0.9, NAN)), ValueError, "Invalid beta parameter at index 1: nan")
        for cls in WITH_BETAS
    ]
    + [
        (cls, dict(betas=(0.9, -0.5)), ValueError, "Invalid beta parameter at index 1: -0.5")
        for cls in WITH_BETAS
    ]
    + [(cls, dict(betas=0.9), TypeError, "betas must be a pair") for cls in WITH_BETAS]
    + [
        (cls, dict(max_grad_norm=-1.0), ValueError, "Invalid max_grad_norm value: -1.0")
        for cls in (FusedLAMB, FusedMixedPrecisionLamb)
    ]
    + [
        (FusedSGD, dict(momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
        (FusedSGD, dict(dampening=NAN), ValueError, "Invalid dampening value: nan"),
        (FusedSGD, dict(momentum=NAN), ValueError, "Invalid momentum value: nan"),
        (FusedAdam, dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
        (FusedAdam, dict(lr=torch.tensor(-1.0)), ValueError, "Invalid learning rate: -1.0"),
    ]
)


@pytest.mark.parametrize(
    "cls, kwargs, exc, message",
    [
        pytest.param(*case, id=f"{case[0].__name__}-{'-'.join(map(str, case[1]))}")
        for case in BAD_VALUES
    ],
)
def test_invalid_hyperparameters_raise_as_torch(cls, kwargs, exc, message):
    kw = {"lr": 0.1, **kwargs} if cls is FusedSGD else kwargs
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(".", r"\.")) as info:
        cls(_params((2,)), **kw)
    assert type(info.value) is exc


@pytest.mark.parametrize(
    "ours, theirs, kwargs",
    [
        (FusedAdam, torch.optim.AdamW, dict(lr=-1.0)),
        (FusedAdam, torch.optim.AdamW, dict(eps=-1.0)),
        (FusedAdam, torch.optim.AdamW, dict(betas=(0.9, 1.0))),
        (FusedAdam, torch.optim.Adam, dict(betas=(-0.1, 0.99))),
        (FusedAdam, torch.optim.AdamW, dict(weight_decay=-1.0)),
        (FusedAdam, torch.optim.AdamW, dict(lr=NAN)),
        (FusedSGD, torch.optim.SGD, dict(lr=-0.5)),
        (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=-1.0)),
        (FusedSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=-1.0)),
        (FusedSGD, torch.optim.SGD, dict(lr=0.1, nesterov=True)),
        (FusedAdagrad, torch.optim.Adagrad, dict(lr=-1.0)),
        (FusedAdagrad, torch.optim.Adagrad, dict(eps=-1.0)),
        (FusedAdagrad, torch.optim.Adagrad, dict(weight_decay=-1.0)),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "-".join(map(str, x)),
)
def test_validation_messages_are_torchs(ours, theirs, kwargs):
    with pytest.raises(ValueError) as want:
        theirs(_params((2,)), **kwargs)
    with pytest.raises(ValueError) as got:
        ours(_params((2,)), **kwargs)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad])
def test_torch_positional_order_explains_apex_order(cls):
    """``FusedAdam(params, 1e-3, (0.9, 0.999))``: torch's positional order lands betas in Apex's
    ``bias_correction`` slot (before, silently taken as True, with the default betas)."""
    with pytest.raises(
        TypeError,
        match=r"(?s)bias_correction got \(0\.9, 0\.999\).*Apex's "
        rf"positional order is {cls.__name__}\(params, lr, bias_correction, betas",
    ):
        cls(_params((2,)), 1e-3, (0.9, 0.999))


def test_mixed_precision_lamb_positional_betas_land_in_step():
    with pytest.raises(TypeError, match=r"step got \(0\.9, 0\.999\).*\(params, lr, step, "):
        FusedMixedPrecisionLamb(_params((2,)), 1e-3, (0.9, 0.999))


@pytest.mark.parametrize("make", FACTORIES)
def test_foreach_and_fused_are_accepted_no_ops(make):
    outs = []
    for kw in ({}, dict(foreach=True), dict(foreach=False, fused=True), dict(fused=None)):
        ps = _params((3, 2))
        opt = make(ps, **kw)
        _set_grads(ps, 0)
        opt.step()
        outs.append(ps[0].detach().clone())
        assert "foreach" not in opt.param_groups[0] and "fused" not in opt.param_groups[0]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("make", FACTORIES)
def test_differentiable_is_rejected(make):
    with pytest.raises(NotImplementedError, match=r"Fused\w+ does not support differentiable"):
        make(_params((2,)), differentiable=True)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb])
def test_maximize_is_rejected_where_not_implemented(cls):
    with pytest.raises(NotImplementedError, match=rf"{cls.__name__} does not support maximize"):
        cls(_params((2,)), maximize=True)
    cls(_params((2,)), maximize=False)


MAXIMIZE_CASES = [
    pytest.param(
        lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, maximize=True),
        id="adamw",
    ),
    pytest.param(
        lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False, **kw),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, maximize=True),
        id="adam-l2",
    ),
    pytest.param(
        lambda ps, **kw: FusedAdam(
            ps, lr=torch.tensor(1e-2, device=ps[0].device), weight_decay=0.1, capturable=True, **kw
        ),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, maximize=True),
        id="adamw-capturable",
    ),
    pytest.param(
        lambda ps, **kw: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, **kw),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, maximize=True),
        id="sgd-momentum",
    ),
    pytest.param(
        lambda ps, **kw: FusedSGD(ps, lr=1e-2, **kw),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, maximize=True),
        id="sgd-plain",
    ),
    pytest.param(
        lambda ps, **kw: FusedAdagrad(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=0.1, maximize=True),
        id="adagrad",
    ),
]


@pytest.mark.parametrize("make, make_torch", MAXIMIZE_CASES)
def test_maximize_matches_torch_and_negated_grads(make, make_torch, device):
    """maximize=True negates the grad inside the kernel (grads are left as they are): the same
    as torch.optim's maximize, and bitwise the same as minimizing with negated grads."""
    ours, negated, theirs = (_params((4, 3), (7,), device=device) for _ in range(3))
    opt, neg, ref = make(ours, maximize=True), make(negated), make_torch(theirs)
    assert opt.param_groups[0]["maximize"] is True
    for step in range(4):
        _set_grads(ours, step)
        _set_grads(negated, step, sign=-1.0)
        _set_grads(theirs, step)
        grads = [p.grad.clone() for p in ours]
        opt.step()
        neg.step()
        ref.step()
        for p, g in zip(ours, grads, strict=True):
            assert torch.equal(p.grad, g)  # not negated in place
    for a, n, t in zip(ours, negated, theirs, strict=True):
        assert torch.equal(a, n)
        torch.testing.assert_close(a, t, rtol=1.3e-6, atol=1e-6)


def test_maximize_is_per_group():
    a, b = _params((3,), (3,))
    opt = FusedAdam([{"params": [a], "maximize": True}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    start_a, start_b = a.detach().clone(), b.detach().clone()
    opt.step()
    assert bool((a > start_a).all()) and bool((b < start_b).all())


# -- load_state_dict copies tensor hyperparameters --------------------------------------------

TENSOR_LR = [
    pytest.param(lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2), id="FusedMixedPrecisionLamb"),
    pytest.param(
        lambda ps: FusedAdam(ps, lr=torch.tensor(1e-2), capturable=True), id="FusedAdam-capturable"
    ),
]


@pytest.mark.parametrize("make", TENSOR_LR)
def test_loaded_tensor_lr_is_a_copy(make):
    """Regression: after ``b.load_state_dict(a.state_dict())`` both shared a's lr tensor, so a
    scheduler on b changed a's lr."""
    pa, pb = _params((3, 2)), _params((3, 2))
    a, b = make(pa), make(pb)
    _set_grads(pa, 0)
    a.step()
    b.load_state_dict(a.state_dict())
    assert _group_lr(b.param_groups[0]) == _group_lr(a.param_groups[0]) == pytest.approx(1e-2)
    sched = torch.optim.lr_scheduler.StepLR(b, step_size=1, gamma=0.5)
    _set_grads(pb, 1)
    b.step()
    sched.step()
    assert _group_lr(b.param_groups[0]) == pytest.approx(5e-3)
    assert _group_lr(a.param_groups[0]) == pytest.approx(1e-2)
    for key, value in b.param_groups[0].items():
        other = a.param_groups[0].get(key)
        if torch.is_tensor(value) and torch.is_tensor(other):
            assert value.data_ptr() != other.data_ptr(), key
    assert torch.is_tensor(b.param_groups[0]["lr"])  # still read on the device


def test_loaded_novograd_second_moments_are_a_copy():
    """The same for NovoGrad's per-group second-moment vector (a tensor in the group)."""
    pa = _params((3, 2), (4,))
    pb = [p.detach().clone().requires_grad_() for p in pa]
    a, b = FusedNovoGrad(pa, lr=1e-2), FusedNovoGrad(pb, lr=1e-2)
    _set_grads(pa, 0)
    a.step()
    b.load_state_dict(a.state_dict())
    before = a.param_groups[0]["exp_avg_sq"].clone()
    _set_grads(pb, 1)
    b.step()
    assert torch.equal(a.param_groups[0]["exp_avg_sq"], before)
    assert not torch.equal(b.param_groups[0]["exp_avg_sq"], before)


def test_loaded_float_lr_into_mixed_precision_lamb_stays_a_device_tensor():
    ps = _params((3,))
    opt = FusedMixedPrecisionLamb(ps, lr=1e-2)
    lr_tensor = opt.param_groups[0]["lr"]
    sd = FusedLAMB(_params((3,)), lr=0.125).state_dict()
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] is lr_tensor  # written in place: a captured step sees it
    assert lr_tensor.item() == 0.125


# -- FusedMixedPrecisionLamb per-group lr -----------------------------------------------------


def test_mixed_precision_lamb_honours_per_group_float_lr():
    """Regression: every group got the constructor's lr."""
    ours, ref_params = _params((4, 3), (5,)), _params((4, 3), (5,))
    groups = lambda ps: [{"params": [ps[0]], "lr": 0.1}, {"params": [ps[1]]}]  # noqa: E731
    opt = FusedMixedPrecisionLamb(groups(ours), lr=1e-3)
    ref = FusedLAMB(groups(ref_params), lr=1e-3, capturable=True)
    assert [g["lr"].item() for g in opt.param_groups] == pytest.approx([0.1, 1e-3])
    for step in range(3):
        _set_grads(ours, step)
        _set_grads(ref_params, step)
        opt.step()
        ref.step()
    for a, b in zip(ours, ref_params, strict=True):
        assert torch.equal(a, b)


# -- masters follow the params ------------------------------------------------------------------

# (class with fp32 masters of bf16 params, the same class on fp32 params: no masters, its params
# are what the masters must track)
MASTER_KEEPERS = [
    pytest.param(
        lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, master_weights=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        id="FusedAdam",
    ),
    pytest.param(
        lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, master_weights=True),
        lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1),
        id="FusedLAMB",
    ),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(
            ps, lr=1e-2, weight_decay=0.1, reduced_precision_dtype=torch.bfloat16
        ),
        lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1),
        id="FusedMixedPrecisionLamb",
    ),
]
MASTER_TOL = dict(rtol=1e-2, atol=2e-3)  # bf16-rounded grads against fp32 ones, a few steps


def _master_pair(make, make_ref, dtype=torch.bfloat16):
    ref = _params((6, 5), (7,), seed=3)
    ours = [p.detach().to(dtype).requires_grad_() for p in ref]
    ref = [p.detach().to(dtype).float().requires_grad_() for p in ref]  # same start
    return ours, make(ours), ref, make_ref(ref)


def _master_steps(ours, opt, ref, ref_opt, steps):
    for step in steps:
        _set_grads(ref, step)
        for p, q in zip(ours, ref):
            p.grad = q.grad.to(p.dtype)
        opt.step()
        ref_opt.step()


def _masters_of(opt, ours):
    return [opt.state[p]["master_param"] for p in ours]


@pytest.mark.parametrize("make, make_ref", MASTER_KEEPERS)
def test_masters_follow_a_loaded_model(make, make_ref):
    """Regression: after ``model.load_state_dict`` (weights 0.5) and one step, the bf16 params
    were back near the stale fp32 masters (0.838 away). A write into a param is where the next
    step starts, as for the fp32 optimizer that keeps no master."""
    ours, opt, ref, ref_opt = _master_pair(make, make_ref)
    _master_steps(ours, opt, ref, ref_opt, range(3))
    model, ref_model = nn.ParameterList(ours), nn.ParameterList(ref)
    for m in (model, ref_model):
        m.load_state_dict({k: torch.full_like(v, 0.5) for k, v in m.state_dict().items()})
    _master_steps(ours, opt, ref, ref_opt, range(3, 5))
    for m, p, q in zip(_masters_of(opt, ours), ours, ref):
        torch.testing.assert_close(m, q.detach(), **MASTER_TOL)
        assert torch.equal(p, m.to(p.dtype))


@pytest.mark.parametrize("make, make_ref", MASTER_KEEPERS)
def test_masters_follow_an_in_place_write_and_keep_the_rest(make, make_ref):
    """An in-place write into part of a param re-seeds only the written elements' masters: the
    others keep their fp32 value (it still rounds to the param), so they track fp32 training."""
    ours, opt, ref, ref_opt = _master_pair(make, make_ref)
    _master_steps(ours, opt, ref, ref_opt, range(3))
    before = [m.clone() for m in _masters_of(opt, ours)]
    assert any(not torch.equal(m, p.float()) for m, p in zip(before, ours))  # masters hold bits
    with torch.no_grad():
        for p in (ours[0], ref[0]):
            nn.init.constant_(p[1:3], -0.25)
    _master_steps(ours, opt, ref, ref_opt, range(3, 4))
    for m, q in zip(_masters_of(opt, ours), ref):
        torch.testing.assert_close(m, q.detach(), **MASTER_TOL)
    # what was not written started the step from its old master, not from the bf16 param: the
    # same as a run without the write (LAMB's trust ratio is per param: Adam's rows only)
    ours2, opt2, ref2, ref_opt2 = _master_pair(make, make_ref)
    _master_steps(ours2, opt2, ref2, ref_opt2, range(4))
    assert torch.equal(_masters_of(opt, ours)[1], _masters_of(opt2, ours2)[1])
    if isinstance(opt, FusedAdam):
        moved, kept = _masters_of(opt, ours)[0], _masters_of(opt2, ours2)[0]
        assert torch.equal(moved[3:], kept[3:]) and torch.equal(moved[0], kept[0])


@pytest.mark.parametrize("make, make_ref", MASTER_KEEPERS)
def test_masters_cost_nothing_when_no_param_changed(make, make_ref, monkeypatch):
    """Steps with no write into the params merge no master (no pass over the params); one write
    merges exactly the written param."""
    from shardopt.optimizers import masters

    calls = []
    merge = masters.merge_master
    monkeypatch.setattr(masters, "merge_master", lambda m, p: calls.append(p.shape) or merge(m, p))
    ours, opt, ref, ref_opt = _master_pair(make, make_ref)
    _master_steps(ours, opt, ref, ref_opt, range(4))
    assert calls == []
    with torch.no_grad():
        ours[1].add_(1.0)
    _master_steps(ours, opt, ref, ref_opt, range(4, 6))
    assert calls == [ours[1].shape]


@pytest.mark.parametrize("make, make_ref", MASTER_KEEPERS)
def test_loaded_masters_are_kept_only_where_they_round_to_the_params(make, make_ref):
    """A saved optimizer state loaded with the model it was saved with resumes bit for bit; loaded
    into a model whose weights were changed since, the params win."""
    ours, opt, ref, ref_opt = _master_pair(make, make_ref)
    _master_steps(ours, opt, ref, ref_opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in ours]
    _master_steps(ours, opt, ref, ref_opt, range(2, 4))
    want = [m.clone() for m in _masters_of(opt, ours)]
    with torch.no_grad():  # back to step 2: model and optimizer
        for p, s in zip(ours, saved_params):
            p.copy_(s)
    opt.load_state_dict(saved)
    _master_steps(ours, opt, ref, ref_opt, range(2, 4))
    for m, w in zip(_masters_of(opt, ours), want):
        assert torch.equal(m, w)
    with torch.no_grad():
        ours[0].fill_(0.5)
    opt.load_state_dict(saved)
    assert torch.equal(_masters_of(opt, ours)[0], saved["state"][0]["master_param"])
    assert (saved["state"][0]["master_param"] - 0.5).abs().max() > 0.5
    for p in ours:
        p.grad = torch.zeros_like(p)
    opt.step()  # one step of at most about lr from where the params are
    assert (_masters_of(opt, ours)[0] - 0.5).abs().max() < 0.05
