"""FusedMuon against the fp64 reference and torch.optim.Muon; the Muon/AdamW split helper.

Tolerances (docs/spec.md "FusedMuon"): with ``ns_dtype=torch.float32`` the params stay within
1e-4 of the update's norm of the fp64 reference; with bf16 Newton-Schulz (torch's) within 3e-2 of
the update's norm of torch.optim.Muon (two valid bf16 orderings differ by 1-2%, a wrong rule by
O(1)). "The update's norm" is ``||p_ref - p_start||`` after the same steps.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import DEVICES

from shardopt import FusedAdam, FusedMuon, muon_param_groups, reference

FP32_NS_TOL = 1e-4
BF16_NS_TOL = 3e-2
STEPS = 3
STATE_ADAMW = {"exp_avg", "exp_avg_sq", "step"}
# tall, wide, square, two of one shape (one batch), 3-D stack
SHAPES = [(8, 16), (16, 8), (8, 16), (12, 12), (3, 6, 10)]
TORCH_SHAPES = [s for s in SHAPES if len(s) == 2]
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]

# every configuration torch.optim.Muon accepts, up to the values of its floats
OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(nesterov=False), id="no-nesterov"),
    pytest.param(dict(adjust_lr_fn="original"), id="original"),
    pytest.param(dict(adjust_lr_fn="match_rms_adamw", lr=1e-2), id="match-rms-adamw"),
    pytest.param(dict(weight_decay=0.0), id="no-wd"),
    pytest.param(dict(weight_decay=0.5, momentum=0.9), id="wd-momentum"),
    pytest.param(dict(momentum=0.0, nesterov=False), id="no-momentum"),
    pytest.param(dict(ns_steps=3, eps=1e-5), id="ns-steps-eps"),
    pytest.param(dict(ns_coefficients=(3.0, -3.2, 1.2)), id="coefficients"),
]


def _rel(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """``||got - want|| / ||want - start||`` in fp64: the error relative to the update's norm."""
    want = want.detach().double()
    moved = (want - start.double()).norm()
    assert moved > 0, "the reference did not move"
    return ((got.detach().double() - want).norm() / moved).item()


def _grads(shapes, dtype, device, scale: float = 1.0) -> list[torch.Tensor]:
    return [(torch.randn(s, dtype=torch.float64) * scale).to(device, dtype) for s in shapes]


def _params(shapes, dtype, device, scale: float = 1.0) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(g) for g in _grads(shapes, dtype, device, scale)]


def _run(opt, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS + [pytest.param(dict(flatten=True), id="flatten")])
def test_matches_fp64_reference(options, device):
    shapes = SHAPES + [(4, 3, 2, 2)]
    params = _params(shapes, torch.float32, device)
    start = [p.detach().clone() for p in params]
    options = {"lr": 0.02, **options}
    opt = FusedMuon(params, ns_dtype=torch.float32, **options)
    ref = reference.Muon(start, **options)
    for _ in range(STEPS):
        grads = _grads(shapes, torch.float32, device)
        _run(opt, params, grads)
        ref.step(grads)
        for p, r, s in zip(params, ref.params(), start):
            assert _rel(p, r, s) < FP32_NS_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_per_step_coefficients_match_reference(device):
    params = _params(SHAPES, torch.float32, device)
    start = [p.detach().clone() for p in params]
    opt = FusedMuon(params, lr=0.02, ns_coefficients=POLAR_EXPRESS, ns_dtype=torch.float32)
    ref = reference.Muon(start, lr=0.02, ns_coefficients=POLAR_EXPRESS)
    one_triple = reference.Muon(start, lr=0.02)
    for _ in range(STEPS):
        grads = _grads(SHAPES, torch.float32, device)
        _run(opt, params, grads)
        ref.step(grads)
        one_triple.step(grads)
    for p, r, o, s in zip(params, ref.params(), one_triple.params(), start):
        assert _rel(p, r, s) < FP32_NS_TOL
        assert _rel(p, o, s) > 10 * FP32_NS_TOL  # the per-step triples were used


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_muon(options, dtype, device):
    if dtype == torch.bfloat16 and options.get("nesterov") is False:
        pytest.skip("torch 2.13 normalises bf16 buffers in place: test_bf16_without_nesterov")
    # bf16 params: steps of many ulps, so a rounding flip is small against the update
    scale, lr = (0.1, 0.2) if dtype == torch.bfloat16 else (1.0, 0.02)
    options = {"lr": lr, **options}
    params = _params(TORCH_SHAPES, dtype, device, scale)
    start = [p.detach().clone() for p in params]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, torch_opt = FusedMuon(params, **options), torch.optim.Muon(theirs, **options)
    for _ in range(STEPS):
        grads = _grads(TORCH_SHAPES, dtype, device)
        _run(opt, params, grads)
        _run(torch_opt, theirs, grads)
        for p, t, s in zip(params, theirs, start):
            assert _rel(p, t, s) < BF16_NS_TOL


def test_stacks_and_conv_weights_are_torch_on_each_matrix():
    """A (3, 8, 16) param is three torch.optim.Muon matrices; a conv weight with flatten=True is
    torch's Muon on its (out, in*kh*kw) view (each with its own shape scale)."""
    stack = torch.nn.Parameter(torch.randn(3, 16, 8))
    conv = torch.nn.Parameter(torch.randn(6, 2, 3, 3))
    slices = [torch.nn.Parameter(m.detach().clone()) for m in stack]
    conv2d = torch.nn.Parameter(conv.detach().reshape(6, 18).clone())
    opt = FusedMuon([{"params": [stack]}, {"params": [conv], "flatten": True}], lr=0.05)
    torch_opt = torch.optim.Muon(slices + [conv2d], lr=0.05)
    for _ in range(STEPS):
        g_stack, g_conv = torch.randn(3, 16, 8), torch.randn(6, 2, 3, 3)
        stack.grad, conv.grad = g_stack, g_conv
        for s, g in zip(slices, g_stack):
            s.grad = g.clone()
        conv2d.grad = g_conv.reshape(6, 18).clone()
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(stack.detach(), torch.stack([s.detach() for s in slices]))
    torch.testing.assert_close(conv.detach(), conv2d.detach().reshape(6, 2, 3, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_with_fp32_masters(device):
    params = _params(SHAPES, torch.bfloat16, device)
    start = [p.detach().clone() for p in params]
    opt = FusedMuon(params, lr=0.02, ns_dtype=torch.float32, master_weights=True)
    ref = reference.Muon(start, lr=0.02)
    for _ in range(STEPS):
        grads = _grads(SHAPES, torch.bfloat16, device)
        _run(opt, params, grads)
        ref.step(grads)
        for p, r, s in zip(params, ref.params(), start):
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32
            assert opt.state[p]["momentum_buffer"].dtype == torch.float32
            assert _rel(master, r, s) < FP32_NS_TOL
            assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_bf16_without_nesterov_keeps_its_momentum():
    """torch 2.13 divides a bf16 param's buffer by its norm in place when nesterov=False; ours
    stays the EMA of the grads (torch's own lerp, in bf16), and the params follow fp32 torch
    (which has no such bug)."""
    shape = (32, 64)
    p = torch.nn.Parameter((torch.randn(shape) * 0.1).bfloat16())
    p32 = torch.nn.Parameter(p.detach().float())
    start = p32.detach().clone()
    opt = FusedMuon([p], lr=0.2, nesterov=False)
    torch_fp32 = torch.optim.Muon([p32], lr=0.2, nesterov=False)
    buf = torch.zeros(shape, dtype=torch.bfloat16)
    for _ in range(STEPS):
        g = torch.randn(shape).bfloat16()
        buf.lerp_(g, 0.05)
        p.grad, p32.grad = g, g.float()
        opt.step()
        torch_fp32.step()
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)
        assert _rel(p, p32, start) < BF16_NS_TOL


def test_state_dicts_in_and_out_of_torch_muon():
    params = _params(TORCH_SHAPES, torch.float32, "cpu")
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedMuon(params, lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw")
    torch_opt = torch.optim.Muon(theirs, lr=0.02)
    grads = _grads(TORCH_SHAPES, torch.float32, "cpu")
    _run(opt, params, grads)
    saved = opt.state_dict()
    assert {k for k in saved["param_groups"][0]} >= set(torch_opt.state_dict()["param_groups"][0])
    assert all(set(s) == {"momentum_buffer"} for s in saved["state"].values())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    torch_opt.load_state_dict(torch.load(buffer, weights_only=True))  # ours -> torch
    for p, t in zip(params, theirs):
        t.data.copy_(p.detach())
    assert torch_opt.param_groups[0]["nesterov"] is False
    fresh = FusedMuon([torch.nn.Parameter(p.detach().clone()) for p in params])
    for _ in range(2):
        grads = _grads(TORCH_SHAPES, torch.float32, "cpu")
        _run(opt, params, grads)
        _run(torch_opt, theirs, grads)
    fresh.load_state_dict(torch_opt.state_dict())  # torch -> ours
    assert fresh.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    fresh_params = fresh.param_groups[0]["params"]
    for p, t in zip(fresh_params, theirs):
        p.data.copy_(t.detach())
    start = [t.detach().clone() for t in theirs]
    for _ in range(2):
        grads = _grads(TORCH_SHAPES, torch.float32, "cpu")
        _run(fresh, fresh_params, grads)
        _run(opt, params, grads)
        _run(torch_opt, theirs, grads)
    for p, q, t, s in zip(params, fresh_params, theirs, start):
        assert _rel(p, t, s) < BF16_NS_TOL
        assert _rel(q, t, s) < BF16_NS_TOL


class TinyGPT(torch.nn.Module):
    """Embeddings, two blocks of attention/MLP-shaped linears with norms, a head (tied or not)."""

    def __init__(self, vocab: int = 32, dim: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(8, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(
                    ln=torch.nn.LayerNorm(dim),
                    qkv=torch.nn.Linear(dim, 3 * dim),
                    proj=torch.nn.Linear(dim, dim, bias=False),
                    fc=torch.nn.Linear(dim, 4 * dim),
                    out=torch.nn.Linear(4 * dim, dim),
                )
            )
            for _ in range(2)
        )
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            h = b["ln"](x)
            x = x + b["proj"](b["qkv"](h)[..., : x.shape[-1]])
            x = x + b["out"](torch.relu(b["fc"](h)))
        return self.lm_head(self.ln_f(x))


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_split_helper_groups(tied):
    model = TinyGPT(tied=tied)
    groups = muon_param_groups(model, adamw_lr=3e-3, adamw_betas=(0.9, 0.95))
    muon_group, adamw_group = groups
    hidden = {f"blocks.{i}.{n}.weight" for i in range(2) for n in ("qkv", "proj", "fc", "out")}
    assert _names(model, muon_group["params"]) == hidden
    assert adamw_group["use_muon"] is False and adamw_group["lr"] == 3e-3
    expected = {n for n, _ in model.named_parameters()} - hidden
    assert _names(model, adamw_group["params"]) == expected
    assert ("lm_head.weight" in expected) is not tied  # tied: one tensor, named wte.weight
    # names override the rules
    groups = muon_param_groups(model, adamw_names=["blocks.1.*"], muon_names=["wpe.*"])
    assert _names(model, groups[0]["params"]) == {n for n in hidden if n.startswith("blocks.0")} | {
        "wpe.weight"
    }
    with pytest.raises(ValueError, match="matches both"):
        muon_param_groups(model, adamw_names=["wpe.*"], muon_names=["wpe.*"])


def test_split_helper_conv_weights_are_flattened():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    conv_group, adamw_group = muon_param_groups(model)
    assert conv_group["flatten"] is True and conv_group["params"] == [model[0].weight]
    assert len(adamw_group["params"]) == 3  # conv bias, the head's weight and bias


def test_one_optimizer_is_torch_muon_plus_adamw():
    """FusedMuon over muon_param_groups equals torch.optim.Muon on the Muon group and
    torch.optim.AdamW on the rest; one state dict round trip and one lr scheduler cover both."""
    model = TinyGPT()
    twin = copy.deepcopy(model)
    idx = torch.randint(0, 32, (2, 8))
    opt = FusedMuon(muon_param_groups(model, adamw_lr=3e-3, adamw_weight_decay=0.01), lr=0.02)
    muon_group, adamw_group = muon_param_groups(twin)
    torch_muon = torch.optim.Muon(muon_group["params"], lr=0.02)
    torch_adamw = torch.optim.AdamW(adamw_group["params"], lr=3e-3, weight_decay=0.01)
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
        for o in (opt, torch_muon, torch_adamw)
    ]
    start = [p.detach().clone() for p in twin.parameters()]
    n_muon = len(muon_group["params"])
    for step in range(4):
        for m in (model, twin):
            m.zero_grad()
            m(idx).logsumexp(-1).mean().backward()
        opt.step()
        torch_muon.step()
        torch_adamw.step()
        for s in schedulers:
            s.step()
        if step == 1:  # a fresh optimizer and scheduler from the state dicts carry on
            state, sched_state = opt.state_dict(), schedulers[0].state_dict()
            for i, s in state["state"].items():
                assert set(s) == ({"momentum_buffer"} if i < n_muon else STATE_ADAMW)
            opt = FusedMuon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02)
            schedulers[0] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            opt.load_state_dict(state)
            schedulers[0].load_state_dict(sched_state)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02 / 5, 3e-3 / 5])
    for (name, p), q, s in zip(model.named_parameters(), twin.parameters(), start):
        if any(p is m for m in opt.param_groups[0]["params"]):
            assert _rel(p, q, s) < BF16_NS_TOL, name
        else:
            torch.testing.assert_close(p, q, rtol=1.3e-6, atol=1e-5, msg=name)


def test_adamw_groups_match_fused_adam_with_masters():
    params = _params([(5, 3), (7,)], torch.bfloat16, "cpu")
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedMuon([{"params": params, "use_muon": False, "lr": 1e-2}], master_weights=True)
    adam = FusedAdam(twins, lr=1e-2, master_weights=True)
    assert "momentum" not in opt.param_groups[0] and opt.param_groups[0]["eps"] == 1e-8
    for _ in range(STEPS):
        grads = _grads([(5, 3), (7,)], torch.bfloat16, "cpu")
        _run(opt, params, grads)
        _run(adam, twins, grads)
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
        assert torch.equal(opt.state[p]["master_param"], adam.state[t]["master_param"])


MISUSE = [
    pytest.param(dict(lr=-1.0), ValueError, id="lr"),
    pytest.param(dict(momentum=-0.1), ValueError, id="momentum"),
    pytest.param(dict(weight_decay=-0.1), ValueError, id="weight-decay"),
    pytest.param(dict(adjust_lr_fn="spectral"), ValueError, id="adjust-lr-fn"),
    pytest.param(dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, id="tensor-lr"),
]


@pytest.mark.parametrize("kwargs, error", MISUSE)
def test_bad_hyperparameters_raise_torchs_errors(kwargs, error):
    with pytest.raises(error) as theirs:
        torch.optim.Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
    with pytest.raises(error) as ours:
        FusedMuon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_misuse_errors():
    with pytest.raises(ValueError, match=r"only supports 2D parameters.*size: torch.Size\(\[4\]\)"):
        FusedMuon([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="use_muon=False"):
        FusedMuon([{"params": [torch.nn.Parameter(torch.randn(4, 4))]},
                   {"params": [torch.nn.Parameter(torch.randn(()))]}])  # fmt: skip
    m = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="less than 100"):  # torch: at the first step
        FusedMuon(m, ns_steps=100)
    with pytest.raises(ValueError, match="exactly 3 values"):
        FusedMuon(m, ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="ns_steps"):
        FusedMuon(m, ns_coefficients=POLAR_EXPRESS[:4])
    with pytest.raises(TypeError, match="ns_dtype"):
        FusedMuon(m, ns_dtype=torch.int8)
    with pytest.raises(ValueError, match="Invalid beta"):
        FusedMuon([{"params": m, "use_muon": False, "betas": (0.9, 1.5)}])
    # another algorithm's state dict is refused, per group
    sgd = torch.optim.SGD(m, lr=0.1, momentum=0.9)
    adam = torch.optim.AdamW(m)
    for p in m:
        p.grad = torch.randn_like(p)
    sgd.step()
    adam.step()
    FusedMuon(m).load_state_dict(sgd.state_dict())  # SGD's momentum_buffer: the same key
    with pytest.raises(ValueError, match="not this optimizer's"):
        FusedMuon(m).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="not this optimizer's"):
        FusedMuon([{"params": m, "use_muon": False}]).load_state_dict(sgd.state_dict())
