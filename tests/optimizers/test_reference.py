"""Validates the fp64 oracle in shardopt.reference against torch.optim and hand-computed numbers."""

import math

import pytest
import torch

from shardopt import reference

SHAPES = [(3, 5), (7,), (2, 3, 4), (1,)]
STEPS = 5


def _make_params(seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64) for shape in SHAPES]


def _run_against_torch(make_ref, make_torch, *, rtol: float, step_kwargs=None) -> None:
    """Feeds the same fresh random grads to both optimizers for STEPS steps and compares params."""
    start = _make_params()
    ref = make_ref([p.clone() for p in start])
    torch_params = [p.clone().requires_grad_() for p in start]
    torch_opt = make_torch(torch_params)
    for _ in range(STEPS):
        grads = [torch.randn_like(p) for p in start]
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        torch_opt.step()
        ref.step(grads, **(step_kwargs or {}))
        for got, want in zip(ref.params(), torch_params, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=rtol, atol=1e-14)
    assert all(not torch.equal(p, s) for p, s in zip(ref.params(), start, strict=True))


# ---------------------------------------------------------------------------------------------
# Defaults and state names
# ---------------------------------------------------------------------------------------------

EXPECTED_DEFAULTS = [
    (
        reference.Adam,
        {},
        dict(
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-8,
            adam_w_mode=True,
            weight_decay=0.0,
        ),
    ),
    (
        reference.LAMB,
        {},
        dict(
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-6,
            weight_decay=0.01,
            adam_w_mode=True,
            grad_averaging=True,
            max_grad_norm=1.0,
            use_nvlamb=False,
        ),
    ),
    (
        reference.NovoGrad,
        {},
        dict(
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            reg_inside_moment=False,
            grad_averaging=True,
            norm_type=2,
            init_zero=False,
        ),
    ),
    (
        reference.SGD,
        {"lr": 0.1},
        dict(
            lr=0.1,
            momentum=0,
            dampening=0,
            weight_decay=0,
            nesterov=False,
            wd_after_momentum=False,
        ),
    ),
    (
        reference.Adagrad,
        {},
        dict(lr=1e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False),
    ),
]


@pytest.mark.parametrize("cls, kwargs, expected", EXPECTED_DEFAULTS)
def test_defaults_match_spec(cls, kwargs, expected):
    opt = cls([torch.zeros(2)], **kwargs)
    assert opt.defaults == expected
    group = opt.param_groups[0]
    assert group["step"] == 0
    assert {k: group[k] for k in expected} == expected


@pytest.mark.parametrize(
    "cls, kwargs, keys",
    [
        (reference.Adam, {}, {"exp_avg", "exp_avg_sq"}),
        (reference.LAMB, {}, {"exp_avg", "exp_avg_sq"}),
        (reference.NovoGrad, {}, {"exp_avg", "exp_avg_sq"}),
        (reference.SGD, {"lr": 0.1, "momentum": 0.9}, {"momentum_buffer"}),
        (reference.Adagrad, {}, {"sum"}),
    ],
)
def test_state_names_and_dtype(cls, kwargs, keys):
    p = torch.randn(4, dtype=torch.float32)
    before = p.clone()
    opt = cls([p], **kwargs)
    assert opt.params()[0].dtype == torch.float64
    opt.step([torch.randn(4, dtype=torch.float32)])
    assert set(opt.state[0]) == keys
    assert all(t.dtype == torch.float64 for t in opt.state[0].values())
    assert torch.equal(p, before), "the caller's tensor must not be updated"
    assert not torch.equal(opt.params()[0], before.double())

    fp32 = cls([p], dtype=torch.float32, **kwargs)
    fp32.step([torch.randn(4, dtype=torch.float64)])
    assert fp32.params()[0].dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in fp32.state[0].values())


def test_params_are_copies_even_in_the_same_dtype():
    p = torch.randn(4, dtype=torch.float64)
    before = p.clone()
    opt = reference.SGD([p], lr=0.1)
    opt.step([torch.ones(4, dtype=torch.float64)])
    assert torch.equal(p, before)
    torch.testing.assert_close(opt.params()[0], before - 0.1, rtol=0, atol=1e-15)


def test_novograd_second_moment_is_0dim():
    opt = reference.NovoGrad([torch.randn(3, 4)])
    opt.step([torch.randn(3, 4)])
    assert opt.state[0]["exp_avg_sq"].shape == ()
    assert opt.state[0]["exp_avg"].shape == (3, 4)


# ---------------------------------------------------------------------------------------------
# Against torch.optim
# ---------------------------------------------------------------------------------------------


def test_adam_l2_mode_matches_torch_adam():
    hp = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    _run_against_torch(
        lambda ps: reference.Adam(ps, adam_w_mode=False, **hp),
        lambda ps: torch.optim.Adam(ps, **hp),
        rtol=1e-12,
    )


def test_adam_w_mode_matches_torch_adamw():
    hp = dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.3)
    _run_against_torch(
        lambda ps: reference.Adam(ps, adam_w_mode=True, **hp),
        lambda ps: torch.optim.AdamW(ps, **hp),
        rtol=1e-10,
    )


@pytest.mark.parametrize(
    "momentum, dampening, nesterov, weight_decay",
    [
        (0.0, 0.0, False, 0.0),
        (0.0, 0.0, False, 0.05),
        (0.9, 0.0, False, 0.05),
        (0.9, 0.3, False, 0.05),
        (0.9, 0.0, True, 0.05),
        (0.7, 0.0, True, 0.0),
    ],
)
def test_sgd_matches_torch_sgd(momentum, dampening, nesterov, weight_decay):
    hp = dict(
        lr=0.05,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
    )
    _run_against_torch(
        lambda ps: reference.SGD(ps, **hp),
        lambda ps: torch.optim.SGD(ps, **hp),
        rtol=1e-12,
    )


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_matches_torch_adagrad(weight_decay):
    hp = dict(lr=0.05, eps=1e-9, weight_decay=weight_decay)
    _run_against_torch(
        lambda ps: reference.Adagrad(ps, **hp),
        lambda ps: torch.optim.Adagrad(ps, **hp),
        rtol=1e-12,
    )


def test_two_groups_with_different_lr_and_a_scheduler_match_torch():
    start = _make_params()
    hp = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    ref = reference.Adam(
        [{"params": start[:2], "lr": 1e-2}, {"params": start[2:], "lr": 3e-3, "eps": 1e-6}],
        adam_w_mode=False,
        **hp,
    )
    torch_params = [p.clone().requires_grad_() for p in start]
    torch_opt = torch.optim.Adam(
        [
            {"params": torch_params[:2], "lr": 1e-2},
            {"params": torch_params[2:], "lr": 3e-3, "eps": 1e-6},
        ],
        **hp,
    )
    assert [g["lr"] for g in ref.param_groups] == [1e-2, 3e-3]
    assert [g["eps"] for g in ref.param_groups] == [1e-8, 1e-6]
    for step in range(STEPS):
        if step == 2:
            for groups in (ref.param_groups, torch_opt.param_groups):
                for group in groups:
                    group["lr"] *= 0.5
        grads = [torch.randn_like(p) for p in start]
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        torch_opt.step()
        ref.step(grads)
        for got, want in zip(ref.params(), torch_params, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# Skipped params and step counting
# ---------------------------------------------------------------------------------------------


def test_none_grads_are_skipped_like_torch():
    start = _make_params()
    ref = reference.Adam([p.clone() for p in start], lr=1e-2, adam_w_mode=False, weight_decay=0.1)
    torch_params = [p.clone().requires_grad_() for p in start]
    torch_opt = torch.optim.Adam(torch_params, lr=1e-2, weight_decay=0.1)
    for _ in range(STEPS):
        grads = [torch.randn_like(p) for p in start]
        grads[1] = None
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        torch_opt.step()
        ref.step(grads)
    assert sorted(ref.state) == [0, 2, 3]
    assert torch.equal(ref.params()[1], start[1])
    for i in (0, 2, 3):
        torch.testing.assert_close(ref.params()[i], torch_params[i].detach(), rtol=1e-12, atol=0)


def test_steps_are_counted_per_group():
    a, b, c = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.25]), torch.tensor([3.0])
    ref = reference.Adam([{"params": [a, b]}, {"params": [c]}], lr=0.1, weight_decay=0.0)
    g = torch.tensor([0.3, -0.4, 1.2])
    ref.step([g, None, None])
    ref.step([g, None, None])
    assert [group["step"] for group in ref.param_groups] == [2, 0]
    assert torch.equal(ref.params()[2], c.double())
    # b's first grad arrives at group step 3: its bias corrections use t=3, not t=1.
    ref.step([g, torch.tensor([0.8]), None])
    assert [group["step"] for group in ref.param_groups] == [3, 0]
    beta1, beta2, eps, lr, t = 0.9, 0.999, 1e-8, 0.1, 3
    m = (1 - beta1) * 0.8
    v = (1 - beta2) * 0.8**2
    want = 0.25 - lr * (m / (1 - beta1**t)) / (math.sqrt(v / (1 - beta2**t)) + eps)
    assert ref.params()[1].item() == pytest.approx(want, rel=1e-13)


def test_grads_are_converted_to_param_dtype_and_length_checked():
    ref = reference.Adagrad([torch.ones(3)])
    ref.step([torch.full((3,), 0.5, dtype=torch.float16)])
    assert ref.state[0]["sum"].dtype == torch.float64
    with pytest.raises(ValueError):
        ref.step([torch.ones(3), torch.ones(3)])


# ---------------------------------------------------------------------------------------------
# Hand-computed cases (plain float math on short lists)
# ---------------------------------------------------------------------------------------------


def test_adam_without_bias_correction_by_hand():
    p0, grads = [1.0, -2.0, 0.5], [[0.3, -0.4, 1.2], [-0.7, 0.1, 0.6]]
    lr, beta1, beta2, eps, wd = 0.1, 0.9, 0.99, 1e-3, 0.2
    ref = reference.Adam(
        [torch.tensor(p0)],
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=wd,
        bias_correction=False,
    )
    p, m, v = list(p0), [0.0] * 3, [0.0] * 3
    for g in grads:
        ref.step([torch.tensor(g, dtype=torch.float64)])
        for i in range(3):
            m[i] = beta1 * m[i] + (1 - beta1) * g[i]
            v[i] = beta2 * v[i] + (1 - beta2) * g[i] ** 2
            p[i] = p[i] - lr * (m[i] / (math.sqrt(v[i]) + eps) + wd * p[i])
    assert ref.params()[0].tolist() == pytest.approx(p, rel=1e-13)
    assert ref.state[0]["exp_avg"].tolist() == pytest.approx(m, rel=1e-13)


def test_sgd_wd_after_momentum_and_scale_by_hand():
    p0, grads = [1.0, -2.0], [[0.3, -0.4], [-0.7, 0.1], [0.2, 0.2]]
    lr, mu, damp, wd, scale = 0.1, 0.9, 0.2, 0.05, 0.5
    ref = reference.SGD(
        [torch.tensor(p0)],
        lr=lr,
        momentum=mu,
        dampening=damp,
        weight_decay=wd,
        wd_after_momentum=True,
    )
    p, buf = list(p0), None
    for g in grads:
        ref.step([torch.tensor(g, dtype=torch.float64)], scale=scale)
        g = [x * scale for x in g]
        buf = (
            list(g)
            if buf is None
            else [mu * b + (1 - damp) * x for b, x in zip(buf, g, strict=True)]
        )
        p = [w - lr * (b + wd * w) for w, b in zip(p, buf, strict=True)]
    assert ref.params()[0].tolist() == pytest.approx(p, rel=1e-13)
    assert ref.state[0]["momentum_buffer"].tolist() == pytest.approx(buf, rel=1e-13)


def test_adagrad_w_mode_by_hand():
    p0, grads = [1.0, -2.0, 0.5], [[0.3, -0.4, 1.2], [-0.7, 0.1, 0.6]]
    lr, eps, wd = 0.1, 1e-10, 0.2
    ref = reference.Adagrad(
        [torch.tensor(p0)], lr=lr, eps=eps, weight_decay=wd, adagrad_w_mode=True
    )
    p, h = list(p0), [0.0] * 3
    for g in grads:
        ref.step([torch.tensor(g, dtype=torch.float64)])
        h = [s + x * x for s, x in zip(h, g, strict=True)]
        p = [w - lr * (x / (math.sqrt(s) + eps) + wd * w) for w, x, s in zip(p, g, h, strict=True)]
    assert ref.params()[0].tolist() == pytest.approx(p, rel=1e-13)


def _lamb_by_hand(
    p,
    grads,
    *,
    lr,
    beta1,
    beta2,
    eps,
    wd,
    max_grad_norm,
    use_nvlamb,
    grad_averaging=True,
    adam_w_mode=True,
):
    """LAMB on one tensor with plain floats, bias correction on."""
    p, m, v = list(p), [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        norm = math.sqrt(sum(x * x for x in g))
        if max_grad_norm > 0 and norm > max_grad_norm:
            g = [x / (norm / max_grad_norm) for x in g]
        if not adam_w_mode:
            g = [x + wd * w for x, w in zip(g, p, strict=True)]
        beta3 = (1 - beta1) if grad_averaging else 1.0
        m = [beta1 * a + beta3 * x for a, x in zip(m, g, strict=True)]
        v = [beta2 * b + (1 - beta2) * x * x for b, x in zip(v, g, strict=True)]
        u = [
            (a / (1 - beta1**t)) / (math.sqrt(b / (1 - beta2**t)) + eps)
            for a, b in zip(m, v, strict=True)
        ]
        if adam_w_mode:
            u = [x + wd * w for x, w in zip(u, p, strict=True)]
        w_norm = math.sqrt(sum(w * w for w in p))
        u_norm = math.sqrt(sum(x * x for x in u))
        use_ratio = (use_nvlamb or wd != 0) and w_norm != 0 and u_norm != 0
        ratio = lr * w_norm / u_norm if use_ratio else lr
        p = [w - ratio * x for w, x in zip(p, u, strict=True)]
    return p


P3, G3 = [1.0, -2.0, 0.5], [0.3, -0.4, 1.2]  # ||G3|| = 1.3
LAMB_BASE = dict(
    lr=0.1, beta1=0.9, beta2=0.999, eps=0.5, wd=0.01, max_grad_norm=1.0, use_nvlamb=False
)


@pytest.mark.parametrize(
    "p0, changes",
    [
        (P3, {}),  # clipping active (1.3 > 1.0), decay on: trust ratio applied
        (P3, {"max_grad_norm": 2.0}),  # clipping inactive
        (P3, {"max_grad_norm": 0.0}),  # clipping off
        (P3, {"wd": 0.0}),  # no decay, no nvlamb: ratio = lr
        (P3, {"wd": 0.0, "use_nvlamb": True}),  # nvlamb: ratio applied without decay
        (P3, {"grad_averaging": False}),
        (P3, {"adam_w_mode": False, "wd": 0.3}),
        ([0.0, 0.0, 0.0], {}),  # ||w|| = 0: ratio = lr
    ],
)
def test_lamb_single_step_by_hand(p0, changes):
    hp = {**LAMB_BASE, **changes}
    ref = reference.LAMB(
        [torch.tensor(p0)],
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["wd"],
        max_grad_norm=hp["max_grad_norm"],
        use_nvlamb=hp["use_nvlamb"],
        grad_averaging=hp.get("grad_averaging", True),
        adam_w_mode=hp.get("adam_w_mode", True),
    )
    ref.step([torch.tensor(G3, dtype=torch.float64)])
    want = _lamb_by_hand(p0, [G3], **hp)
    assert ref.params()[0].tolist() == pytest.approx(want, rel=1e-13, abs=1e-15)


def test_lamb_options_change_the_result():
    def run(**changes):
        return _lamb_by_hand(P3, [G3], **{**LAMB_BASE, **changes})

    assert run() != pytest.approx(run(max_grad_norm=2.0), rel=1e-6)
    assert run(max_grad_norm=2.0) == run(max_grad_norm=0.0)
    assert run(wd=0.0) != pytest.approx(run(wd=0.0, use_nvlamb=True), rel=1e-6)
    # Literal numbers for the unclipped, ratio = lr case: p - lr * g / (|g| + eps).
    assert run(wd=0.0, max_grad_norm=0.0) == pytest.approx(
        [1.0 - 0.1 * 0.3 / 0.8, -2.0 + 0.1 * 0.4 / 0.9, 0.5 - 0.1 * 1.2 / 1.7], rel=1e-12
    )


def test_lamb_two_steps_by_hand():
    grads = [G3, [-0.7, 0.1, 0.6]]
    ref = reference.LAMB([torch.tensor(P3)], lr=0.1, eps=0.5, weight_decay=0.01)
    for g in grads:
        ref.step([torch.tensor(g, dtype=torch.float64)])
    want = _lamb_by_hand(P3, grads, **LAMB_BASE)
    assert ref.params()[0].tolist() == pytest.approx(want, rel=1e-13)


def test_lamb_clips_with_the_global_norm_of_all_groups():
    ga, gb = torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)
    pa, pb = torch.tensor([1.0, 2.0]), torch.tensor([-1.0])
    hp = dict(lr=0.1, eps=0.5, weight_decay=0.0)  # ratio = lr, so the update sees the grad scale
    ref = reference.LAMB([{"params": [pa]}, {"params": [pb], "lr": 0.2}], max_grad_norm=1.0, **hp)
    ref.step([ga, gb])
    # Global norm 5 (not 3 and 4 per group): same as feeding g / 5 without clipping.
    want = reference.LAMB([{"params": [pa]}, {"params": [pb], "lr": 0.2}], max_grad_norm=0.0, **hp)
    want.step([ga / 5, gb / 5])
    per_group = reference.LAMB(
        [{"params": [pa]}, {"params": [pb], "lr": 0.2}], max_grad_norm=0.0, **hp
    )
    per_group.step([ga / 3, gb / 4])
    for got, exp, other in zip(ref.params(), want.params(), per_group.params(), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-14, atol=0)
        assert not torch.allclose(got, other, rtol=1e-6, atol=0)


def test_lamb_grad_scale_is_applied_before_the_norm():
    # ||g|| = 1.3 stays unclipped; ||4 g|| = 5.2 would be clipped to 2 if the scale came later.
    g = torch.tensor(G3, dtype=torch.float64)
    hp = dict(eps=0.5, weight_decay=0.0, max_grad_norm=2.0)
    plain = reference.LAMB([torch.tensor(P3)], **hp)
    plain.step([g])
    scaled = reference.LAMB([torch.tensor(P3)], **hp)
    scaled.step([g * 4], grad_scale=0.25)
    torch.testing.assert_close(scaled.params()[0], plain.params()[0], rtol=1e-14, atol=0)
    unscaled = reference.LAMB([torch.tensor(P3)], **hp)
    unscaled.step([g * 4])
    assert not torch.allclose(unscaled.params()[0], plain.params()[0], rtol=1e-6, atol=0)


def _novograd_by_hand(
    p,
    grads,
    *,
    lr,
    beta1,
    beta2,
    eps,
    wd,
    norm_type,
    init_zero,
    reg_inside_moment,
    grad_averaging=True,
):
    """NovoGrad on one tensor with plain floats, bias correction on."""
    p, m, v = list(p), [0.0] * len(p), 0.0
    beta3 = (1 - beta1) if grad_averaging else 1.0
    for t, g in enumerate(grads, start=1):
        if norm_type == 2:
            n = math.sqrt(sum(x * x for x in g))
        else:
            n = max(abs(x) for x in g)
        if t == 1 and not init_zero:
            v = n
        elif norm_type == 2:
            v = math.sqrt(beta2 * v * v + (1 - beta2) * n * n)
        else:
            v = beta2 * v + (1 - beta2) * n
        b1, b2 = 1 - beta1**t, math.sqrt(1 - beta2**t)
        if reg_inside_moment:
            gp = [x / (v / b2 + eps) + wd * w for x, w in zip(g, p, strict=True)]
            m = [beta1 * a + beta3 * x for a, x in zip(m, gp, strict=True)]
            p = [w - lr * a / b1 for w, a in zip(p, m, strict=True)]
        else:
            m = [beta1 * a + beta3 * x for a, x in zip(m, g, strict=True)]
            p = [w - lr * ((a / b1) / (v / b2 + eps) + wd * w) for w, a in zip(p, m, strict=True)]
    return p, v


NOVO_GRADS = [[0.3, -0.4, 1.2], [-0.7, 0.1, 0.6]]
NOVO_BASE = dict(lr=0.1, beta1=0.9, beta2=0.8, eps=1e-8, wd=0.05)


@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("init_zero", [False, True])
@pytest.mark.parametrize("reg_inside_moment", [False, True])
@pytest.mark.parametrize("grad_averaging", [True, False])
def test_novograd_two_steps_by_hand(norm_type, init_zero, reg_inside_moment, grad_averaging):
    opts = dict(
        norm_type=norm_type,
        init_zero=init_zero,
        reg_inside_moment=reg_inside_moment,
        grad_averaging=grad_averaging,
    )
    ref = reference.NovoGrad(
        [torch.tensor(P3)], lr=0.1, betas=(0.9, 0.8), eps=1e-8, weight_decay=0.05, **opts
    )
    for g in NOVO_GRADS:
        ref.step([torch.tensor(g, dtype=torch.float64)])
    want_p, want_v = _novograd_by_hand(P3, NOVO_GRADS, **NOVO_BASE, **opts)
    assert ref.params()[0].tolist() == pytest.approx(want_p, rel=1e-13)
    assert ref.state[0]["exp_avg_sq"].item() == pytest.approx(want_v, rel=1e-13)


def test_novograd_options_change_the_result():
    def run(**changes):
        opts = dict(norm_type=2, init_zero=False, reg_inside_moment=False)
        return _novograd_by_hand(P3, NOVO_GRADS, **NOVO_BASE, **{**opts, **changes})

    assert run()[1] != pytest.approx(run(norm_type=0)[1], rel=1e-6)
    assert run()[0] != pytest.approx(run(init_zero=True)[0], rel=1e-6)
    assert run()[0] != pytest.approx(run(reg_inside_moment=True)[0], rel=1e-6)
    # Literal second moments: n1 = 1.3, n2 = sqrt(0.86); inf norms 1.2 and 0.7.
    assert run()[1] == pytest.approx(math.sqrt(0.8 * 1.69 + 0.2 * 0.86), rel=1e-14)
    assert run(init_zero=True)[1] == pytest.approx(math.sqrt(0.8 * 0.2 * 1.69 + 0.2 * 0.86))
    assert run(norm_type=0)[1] == pytest.approx(0.8 * 1.2 + 0.2 * 0.7, rel=1e-14)


# ---------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------


def _sgd_without_lr():
    return reference.SGD([torch.zeros(2)])


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: reference.NovoGrad([torch.zeros(2)], norm_type=1), RuntimeError),
        (lambda: reference.NovoGrad([{"params": [torch.zeros(2)], "norm_type": 3}]), RuntimeError),
        (lambda: reference.Adam([torch.zeros(2)], amsgrad=True), RuntimeError),
        (lambda: reference.LAMB([torch.zeros(2)], amsgrad=True), RuntimeError),
        (lambda: reference.NovoGrad([torch.zeros(2)], amsgrad=True), RuntimeError),
        (_sgd_without_lr, TypeError),
        (lambda: reference.SGD([torch.zeros(2)], lr=0.1, nesterov=True), ValueError),
        (
            lambda: reference.SGD(
                [torch.zeros(2)], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True
            ),
            ValueError,
        ),
        (lambda: reference.Adam([]), ValueError),
    ],
)
def test_misuse_raises(make, error):
    with pytest.raises(error):
        make()


def test_novograd_norm_type_changed_after_construction_raises_at_step():
    opt = reference.NovoGrad([torch.zeros(2)])
    opt.param_groups[0]["norm_type"] = 1
    with pytest.raises(RuntimeError, match="norm_type"):
        opt.step([torch.ones(2)])
