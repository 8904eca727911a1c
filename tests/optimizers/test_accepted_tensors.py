"""Every tensor torch.optim takes: params of several dtypes in one group,
params and grads in any memory layout, and kernel calls that refuse what they cannot read; and a
conv net trained in channels_last with fp16 convs under GradScaler, for every class.

Oracles: the same optimizer on one group per dtype, or on contiguous copies of the params (bit for
bit, except the per-tensor norms of LAMB and NovoGrad, summed in storage order), and torch.optim or
the fp64 reference fed the same grads (docs/spec.md tolerances).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES, assert_close_to, make_params

from shardopt import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
    reference,
)
from shardopt import kernels as _ops

FP16, FP32 = torch.float16, torch.float32

# (id, factory of the optimizer from params or groups); one config per class and master option
CONFIGS = [
    pytest.param(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01), id="adam"),
    pytest.param(lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True), id="adam-masters"),
    pytest.param(
        lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
        id="adam-capturable-masters",
    ),
    pytest.param(
        lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), id="sgd"
    ),
    pytest.param(lambda ps: FusedAdagrad(ps, lr=0.05), id="adagrad"),
    pytest.param(lambda ps: FusedLAMB(ps, lr=1e-2, master_weights=True), id="lamb-masters"),
    pytest.param(lambda ps: FusedNovoGrad(ps, lr=0.1), id="novograd"),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=FP16),
        id="mp-lamb",
    ),
]
# per-tensor norms over storage: another layout sums in another order (last bits differ)
SUMS_NORMS = (FusedLAMB, FusedNovoGrad)


def _step_both(a, b, params_a, params_b, grads):
    """One step of ``a`` with ``grads`` as they are and of ``b`` with contiguous copies."""
    for p, q, g in zip(params_a, params_b, grads, strict=True):
        p.grad, q.grad = g, g.contiguous().clone()
    a.step()
    b.step()


def _assert_same(a, b, params_a, params_b, exact: bool, what: str) -> None:
    for i, (p, q) in enumerate(zip(params_a, params_b, strict=True)):
        pairs = [("param", p, q)] + [
            (key, value, b.state[q][key]) for key, value in a.state[p].items()
        ]
        for name, x, y in pairs:
            if exact:
                assert torch.equal(x, y), f"{what}: {name} of param {i} differs"
            else:
                assert_close_to(x, y, FP32, f"{what}: {name} of param {i}")


# -- item 1: mixed dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize("make", CONFIGS)
def test_a_group_mixing_dtypes_equals_one_group_per_dtype(make, device):
    """fp16 and fp32 params in one group (masters for the fp16 ones where the class keeps them)
    give the bits of one group per dtype: the kernels run once per dtype signature."""
    shapes16, shapes32 = [(3, 5), (2, 3, 4)], [(7,), (1,)]
    torch.manual_seed(1)
    mixed = make_params(shapes16, FP16, device) + make_params(shapes32, FP32, device)
    split = [p.clone() for p in mixed]
    start = [p.clone() for p in mixed]
    a, b = make(mixed), make([{"params": split[:2]}, {"params": split[2:]}])
    for _ in range(3):
        _step_both(a, b, mixed, split, [torch.randn(p.shape).to(p) for p in mixed])
    _assert_same(a, b, mixed, split, exact=True, what="mixed group")
    assert all(not torch.equal(p, s) for p, s in zip(mixed, start, strict=True))


def _adam_lists(dtypes, device):
    grads = [torch.ones(3, dtype=d, device=device) for d in dtypes]
    params = [torch.ones(3, dtype=d, device=device) for d in dtypes]
    state = [[torch.zeros(3, device=device) for _ in dtypes] for _ in range(2)]
    return [grads, params, *state]


ADAM_ARGS = dict(
    lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, step=1, adam_w_mode=True, bias_correction=True,
    weight_decay=0.0,
)  # fmt: skip


def test_a_kernel_call_with_a_mixed_list_raises_and_ops_splits_it(device):
    """shardopt._C refuses a slot of two dtypes with a message naming the tensor; _ops splits the
    same lists into one call per dtype."""
    lists = _adam_lists([FP16, FP32], device)
    with pytest.raises(
        RuntimeError,
        match=r"adam: tensor 1 of list 0 \(Float, shape \[3\], strides \[1\]\) has another dtype "
        r"than tensor 0 of that list \(Half\)",
    ):
        _ops.backend(device).adam(lists, **ADAM_ARGS)
    assert all(torch.equal(p, torch.ones_like(p)) for p in lists[1])  # refused before any update
    _ops.adam(lists, **ADAM_ARGS)
    for dtype, p in zip([FP16, FP32], lists[1], strict=True):
        alone = _adam_lists([dtype], device)
        _ops.adam(alone, **ADAM_ARGS)
        assert torch.equal(p, alone[1][0])


def test_the_scale_kernel_takes_mixed_lists(device):
    """GradScaler's unscale of a mixed group (which once crashed on CUDA) is one kernel call."""
    dtypes = [FP16, FP32, torch.bfloat16, FP32]
    src = [torch.randn(s, device=device).to(d) for s, d in zip([5, 70000, 3, 2], dtypes)]
    dst = [torch.empty_like(s, dtype=d) for s, d in zip(src, reversed(dtypes))]
    flag = torch.zeros(1, device=device)
    _ops.backend(device).scale([src, dst], 0.5, None, flag)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s.float() * 0.5).to(d.dtype))
    assert flag.item() == 0.0
    src[2][1] = float("inf")
    _ops.scale(src, src, flag, scale=2.0)
    assert flag.item() == 1.0


def test_a_kernel_call_with_a_layout_it_cannot_read_raises(device):
    """A tensor that is not dense, or that orders its elements unlike its position's list-0 tensor,
    is refused by shardopt._C (_ops passes both through temporaries)."""
    sgd = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
               first_run=False, wd_after_momentum=False, scale=1.0)  # fmt: skip
    base = torch.zeros(4, 6, device=device)
    strided = base[:, ::2]
    grads = [torch.ones(4, 3, device=device)]
    with pytest.raises(RuntimeError, match=r"tensor 0 of list 1 .*strides \[6, 2\]\) is not dense"):
        _ops.backend(device).sgd([grads, [strided], [strided]], **sgd)
    param = torch.zeros(2, 3, 4, 4, device=device).to(memory_format=torch.channels_last)
    grad = torch.ones(2, 3, 4, 4, device=device)
    with pytest.raises(RuntimeError, match=r"tensor 0 of list 1 .* orders its elements unlike"):
        _ops.backend(device).sgd([[grad], [param], [param]], **sgd)
    _ops.sgd([grads, [strided], [strided]], **sgd)
    _ops.sgd([[grad], [param], [param]], **sgd)
    assert torch.equal(base[:, ::2], torch.full((4, 3), -0.1, device=device))
    assert not base[:, 1::2].any()
    assert torch.equal(param, torch.full_like(param, -0.1))


# -- item 3: layouts ---------------------------------------------------------------------------


def _layout_cases(device):
    """(name, param, grad maker): each in a layout the kernels cannot take as one flat array
    next to a contiguous partner, or a grad laid out unlike its param."""
    cl = torch.randn(2, 8, 3, 3, device=device).to(memory_format=torch.channels_last)
    cl3d = torch.randn(2, 4, 3, 2, 2, device=device).to(memory_format=torch.channels_last_3d)
    flat = torch.randn(1 + 7 * 5, device=device)
    strided_base = torch.randn(4, 10, device=device)
    like = torch.randn_like  # the param's strides where it is dense, as AccumulateGrad gives
    return [
        ("channels_last", cl, like),
        ("channels_last_3d", cl3d, like),
        ("transposed", torch.randn(6, 4, device=device).t(), like),
        ("offset", flat[1:].view(7, 5), like),  # 4 bytes past a 16-byte boundary
        ("grad-channels-last", torch.randn(2, 3, 4, 4, device=device),
         lambda p: torch.randn_like(p).to(memory_format=torch.channels_last)),
        ("grad-transposed", torch.randn(5, 6, device=device),
         lambda p: torch.randn(6, 5, device=device).t()),
        ("grad-expanded", torch.randn(4, 5, device=device),
         lambda p: torch.randn(1, 5, device=device).expand(4, 5)),
        ("strided", strided_base[:, ::2], like),
        ("contiguous", torch.randn(9, device=device), like),
    ], strided_base  # fmt: skip


@pytest.mark.parametrize("make", CONFIGS)
def test_params_and_grads_in_any_layout_equal_contiguous_ones(make, device):
    """channels_last(_3d), transposed and offset params, grads with other strides than their
    param's, and a strided (not dense) param: the same result as contiguous copies, state in the
    param's layout (as torch.optim's), and a strided param's base untouched around it."""
    torch.manual_seed(2)
    cases, strided_base = _layout_cases(device)
    names = [c[0] for c in cases]
    params = [c[1] for c in cases]
    copies = [p.contiguous().clone() for p in params]
    base_before = strided_base.clone()
    a, b = make(params), make(copies)
    for _ in range(3):
        grads = [c[2](p) for c, p in zip(cases, params, strict=True)]
        _step_both(a, b, params, copies, grads)
    exact = not isinstance(a, SUMS_NORMS)
    _assert_same(a, b, params, copies, exact=exact, what="layouts")
    for name, p in zip(names, params, strict=True):
        for key, value in a.state[p].items():
            if name != "strided":
                assert _ops.same_layout(value, p), f"{name}: {key} has strides {value.stride()}"
    assert torch.equal(strided_base[:, 1::2], base_before[:, 1::2])
    assert not torch.equal(strided_base, base_before)


def test_low_precision_params_with_masters_in_other_layouts(device):
    """fp16 params in channels_last and strided, with fp32 masters: masters take the layout of
    the param (or a dense one), and the rounded param lands in the param's own storage."""
    torch.manual_seed(3)
    base = torch.randn(3, 8, device=device).half()
    params = [
        torch.randn(2, 8, 3, 3, device=device).half().to(memory_format=torch.channels_last),
        base[:, 1::2],
    ]
    copies = [p.contiguous().clone() for p in params]
    a = FusedAdam(params, lr=1e-2, master_weights=True)
    b = FusedAdam(copies, lr=1e-2, master_weights=True)
    for _ in range(3):
        _step_both(a, b, params, copies, [torch.randn_like(p) for p in params])
    _assert_same(a, b, params, copies, exact=True, what="fp16 masters")
    assert _ops.same_layout(a.state[params[0]]["master_param"], params[0])
    assert torch.equal(params[1], base[:, 1::2])


def test_state_loaded_for_another_layout_takes_the_params(device):
    """A state dict saved with contiguous params restores its state in channels_last params'
    layout, as state created for them would be."""
    p = torch.randn(2, 8, 3, 3, device=device)
    q = p.clone().to(memory_format=torch.channels_last)
    a, b = FusedAdam([p], lr=1e-2), FusedAdam([q], lr=1e-2)
    p.grad = torch.randn_like(p)
    a.step()
    b.load_state_dict(a.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert _ops.same_layout(b.state[q][key], q) and torch.equal(
            b.state[q][key], a.state[p][key]
        )


# -- a conv net in channels_last with fp16 convs under GradScaler, every class ------------------


class ConvNet(torch.nn.Module):
    """Two low-precision convs (channels_last) and an fp32 head: one group of two dtypes and two
    layouts."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1).to(low)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1).to(low)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x.to(self.low)))
        x = torch.relu(self.conv2(x))
        return self.head(x.float().mean((2, 3)))


class TorchReference:
    """A torch.optim optimizer on fp64 CPU copies, with the reference optimizers' interface."""

    def __init__(self, cls, params, **kw) -> None:
        self._params = [p.detach().cpu().double().clone() for p in params]
        self.opt = cls(self._params, foreach=False, **kw)

    def params(self):
        return self._params

    def step(self, grads) -> None:
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g.cpu().double()
        self.opt.step()


# (fused factory, reference factory, whether the optimizer is capturable: GradScaler hands it the
# scale and found_inf, and the kernels unscale; FusedAdam in place in the grads' dtype, the LAMB
# classes in fp32 inside the update)
LOOP_CASES = [
    pytest.param(
        lambda ps: FusedAdam(ps, 1e-3, adam_w_mode=False, capturable=True, master_weights=True),
        lambda ps: TorchReference(torch.optim.Adam, ps, lr=1e-3),
        True,
        id="adam",
    ),
    pytest.param(
        lambda ps: FusedAdam(ps, 1e-3, weight_decay=0.01, capturable=True, master_weights=True),
        lambda ps: TorchReference(torch.optim.AdamW, ps, lr=1e-3, weight_decay=0.01),
        True,
        id="adamw",
    ),
    pytest.param(
        lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda ps: TorchReference(
            torch.optim.SGD, ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
        ),
        False,
        id="sgd",
    ),
    pytest.param(
        lambda ps: FusedAdagrad(ps, lr=0.05),
        lambda ps: TorchReference(torch.optim.Adagrad, ps, lr=0.05),
        False,
        id="adagrad",
    ),
    pytest.param(
        lambda ps: FusedLAMB(ps, lr=1e-2, capturable=True, master_weights=True),
        lambda ps: reference.LAMB(ps, lr=1e-2),
        True,
        id="lamb",
    ),
    pytest.param(
        lambda ps: FusedNovoGrad(ps, lr=1e-2),
        lambda ps: reference.NovoGrad(ps, lr=1e-2),
        False,
        id="novograd",
    ),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=FP16),
        lambda ps: reference.LAMB(ps, lr=1e-2),
        True,
        id="mp-lamb",
    ),
]


@pytest.mark.parametrize("make, make_ref, capturable", LOOP_CASES)
def test_conv_net_in_channels_last_with_low_precision_convs(make, make_ref, capturable, device):
    """The issue's crash: fp16 convs and an fp32 head in one group, channels_last, GradScaler.
    After every step each param equals its reference's at the spec tolerance of its dtype (the
    convs' params cross zero here, so with atol = rtol x max|reference|, as for state).

    torch's GradScaler unscales the grads of an optimizer that does not take the scale itself
    (FusedSGD, FusedAdagrad, FusedNovoGrad, and every torch.optim class) only if they are not
    fp16 ("Attempting to unscale FP16 gradients") and, on CUDA, not bf16 (no kernel): those
    classes train bf16 convs under GradScaler on the CPU and fp16 convs without it on CUDA.
    """
    low = FP16 if capturable or device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    use_scaler = capturable or device.type == "cpu"
    torch.manual_seed(4)
    model = ConvNet(low).to(device).to(memory_format=torch.channels_last)
    params = list(model.parameters())
    opt, ref = make(params), make_ref(params)
    start = [p.detach().clone() for p in params]
    stepped = 0
    for step in range(5):
        x = torch.randn(4, 3, 8, 8, device=device).to(memory_format=torch.channels_last)
        loss = F.cross_entropy(model(x), torch.randint(0, 4, (4,), device=device))
        if not use_scaler:
            loss.backward()
            ref.step([p.grad for p in params])
            opt.step()
            stepped += 1
        else:
            scaler.scale(loss).backward()
            scale = scaler.get_scale()  # a power of 2: unscaling is exact up to the rounding below
            grads = [p.grad.double() / scale for p in params]
            if not isinstance(opt, FusedLAMB):  # unscaled in the grads' dtype (see LOOP_CASES)
                grads = [g.to(p.dtype).double() for g, p in zip(grads, params, strict=True)]
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= scale:  # not skipped on inf/nan
                ref.step(grads)
                stepped += 1
        opt.zero_grad(set_to_none=True)
        for i, (p, r) in enumerate(zip(params, ref.params(), strict=True)):
            atol = TOLERANCES[p.dtype][0] * float(r.abs().max()) if p.dtype == low else None
            assert_close_to(p, r, p.dtype, f"step {step}: param {i}", atol)
            if "master_param" in opt.state[p]:
                assert_close_to(opt.state[p]["master_param"], r, FP32, f"master of param {i}")
    assert stepped >= 3 and not torch.equal(params[0], start[0])
    assert params[0].dtype == low and params[-1].dtype == FP32
    conv = model.conv2.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    for key, value in opt.state[conv].items():
        assert _ops.same_layout(value, conv), f"{key} of a channels_last conv weight"
