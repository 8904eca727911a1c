"""Misuse as a table: (build, expected exception type, message regex)."""

import pytest
import torch

from shardopt import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from shardopt import kernels as _ops

ALL = [
    FusedAdam,
    FusedLAMB,
    FusedNovoGrad,
    FusedAdagrad,
    FusedMixedPrecisionLamb,
    lambda ps, **kw: FusedSGD(ps, lr=0.1, **kw),
]
WITH_AMSGRAD = [FusedAdam, FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb]


def _with_grads(*params):
    for p in params:
        p.grad = torch.ones_like(p)
    return list(params)


def _int_param(cls):
    cls([torch.zeros(3), torch.zeros(3, dtype=torch.int64)])


def _sparse_grad(cls):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    cls(emb.parameters()).step()


def _mixed_devices(cls):
    params = _with_grads(torch.zeros(3, device="meta"), torch.zeros(3))
    cls(params).step()


def _deprecated(name):
    def build(cls):
        cls(_with_grads(torch.zeros(3))).step(**{name: [torch.zeros(3)]})

    return build


def _name(cls):
    return getattr(cls, "__name__", "FusedSGD")


CASES = (
    [(f"int-param-{_name(c)}", c, _int_param, TypeError, r"param 1 .*torch\.int64") for c in ALL]
    + [(f"sparse-{_name(c)}", c, _sparse_grad, RuntimeError, r"SparseAdam") for c in ALL]
    + [
        (
            f"mixed-devices-{_name(c)}",
            c,
            _mixed_devices,
            RuntimeError,
            r"param 1 \(shape \(3,\)\) is on cpu, not on the same device as param 0 \(meta\)",
        )
        for c in ALL
    ]
    + [
        (
            f"amsgrad-{_name(c)}",
            c,
            lambda c: c([torch.zeros(3)], amsgrad=True),
            RuntimeError,
            r"does not support the AMSGrad variant",
        )
        for c in WITH_AMSGRAD
    ]
    + [
        (f"deprecated-{arg}-{_name(c)}", c, _deprecated(arg), RuntimeError, r"step\(\)")
        for c in ALL
        for arg in ("grads", "output_params", "scale", "grad_norms")
    ]
    + [
        (
            "nesterov-without-momentum",
            FusedSGD,
            lambda c: c([torch.zeros(3)], lr=0.1, nesterov=True),
            ValueError,
            r"[Nn]esterov",
        ),
        (
            "nesterov-with-dampening",
            FusedSGD,
            lambda c: c([torch.zeros(3)], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            r"[Nn]esterov",
        ),
        ("sgd-missing-lr", FusedSGD, lambda c: c([torch.zeros(3)]), TypeError, r"lr"),
        (
            "novograd-norm-type-1",
            FusedNovoGrad,
            lambda c: c([torch.zeros(3)], norm_type=1),
            RuntimeError,
            r"norm_type",
        ),
        (
            "mp-lamb-bad-reduced-dtype",
            FusedMixedPrecisionLamb,
            lambda c: c([torch.zeros(3)], reduced_precision_dtype=torch.float32),
            ValueError,
            r"reduced_precision_dtype",
        ),
        (
            "expanded-param",
            FusedAdam,
            lambda c: c(_with_grads(torch.zeros(1, 3).expand(4, 3))).step(),
            RuntimeError,
            r"tensor 0 of list 1 \(shape \(4, 3\), strides \(0, 1\)\) has elements that share "
            r"memory",
        ),
        (
            "load-state-dict-wrong-groups",
            FusedAdam,
            lambda c: c([torch.zeros(3)]).load_state_dict(
                {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}
            ),
            ValueError,
            r"param groups",
        ),
    ]
)


def _case(c):
    return pytest.param(*c[1:], id=c[0])


@pytest.mark.parametrize("cls, build, exc, regex", [_case(c) for c in CASES])
def test_misuse_raises(cls, build, exc, regex):
    with pytest.raises(exc, match=regex) as info:
        build(cls)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value)}"


def test_cuda_tensors_on_a_build_without_cuda_say_how_to_build(monkeypatch):
    monkeypatch.setattr(_ops.extension(), "has_cuda", False)
    with pytest.raises(RuntimeError, match=r"(?s)without CUDA.*(pip install|SHARDOPT_BUILD_CUDA)"):
        _ops.backend(torch.device("cuda"))
    assert _ops.cuda_available() is False


def test_unknown_device_type_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"no kernels for meta tensors"):
        _ops.backend(torch.device("meta"))
