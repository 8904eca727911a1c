"""One definition per algorithm (shardopt/algorithms/), used by both of its classes.

For every pair ``FusedX`` / ``DistributedFusedX``: the constructors take the definition's
hyperparameters with its defaults, in the same order, and keep its state names; the same bad
hyperparameter gives the same error (type and message, up to the class name) in both, which is
the definition's own; and a step of either class computes its kernel's scalar arguments with the
definition's function (patched in real gloo processes, worlds 1 and 3, the patch shows in the
params of both).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pydoc

import pytest
import torch
from dist_harness import run_cases

from shardopt import (
    DistributedFusedAdagrad,
    DistributedFusedAdam,
    DistributedFusedLAMB,
    DistributedFusedNovoGrad,
    DistributedFusedSGD,
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from shardopt.algorithms import adagrad, adam, lamb, mixed_precision_lamb, novograd, sgd

# (algorithm, single-process class, ZeRO class, the function of the kernel's scalar arguments
# whose lr reaches the param update, a valid lr)
PAIRS = [
    (adam, FusedAdam, DistributedFusedAdam, "kernel_args", 1e-2),
    (lamb, FusedLAMB, DistributedFusedLAMB, "stage2_args", 1e-2),
    (novograd, FusedNovoGrad, DistributedFusedNovoGrad, "kernel_args", 1e-2),
    (sgd, FusedSGD, DistributedFusedSGD, "kernel_args", 1e-1),
    (adagrad, FusedAdagrad, DistributedFusedAdagrad, "kernel_args", 1e-1),
]
PAIR_IDS = [single.__name__ for _, single, _, _, _ in PAIRS]


def _fields(algorithm) -> list[dataclasses.Field]:
    return list(dataclasses.fields(algorithm.Hyperparams))


def _hyper_order(cls, names: set[str]) -> list[str]:
    """The constructor's parameters that are hyperparameters of the definition, in order."""
    return [n for n in inspect.signature(cls).parameters if n in names]


@pytest.mark.parametrize("algorithm, single, zero, _fn, _lr", PAIRS, ids=PAIR_IDS)
def test_both_constructors_take_the_definitions_defaults(algorithm, single, zero, _fn, _lr):
    fields = _fields(algorithm)
    names = {f.name for f in fields}
    for cls in (single, zero):
        params = inspect.signature(cls).parameters
        for f in fields:
            assert f.name in params, f"{cls.__name__} lacks {f.name}"
            default = params[f.name].default
            assert default is f.default or (
                type(default) is type(f.default) and default == f.default
            ), f"{cls.__name__}({f.name}={default!r}), the definition says {f.default!r}"
        assert cls.state_names == algorithm.STATE_NAMES
    # the same positional order (Apex's) of the hyperparameters in both
    assert _hyper_order(single, names) == _hyper_order(zero, names)
    # the ZeRO class's positional arguments are exactly the definition's; the keyword-only ones
    # are the sharding arguments (**zero_args), which help() and inspect.signature show too
    signature = inspect.signature(zero).parameters
    kw = inspect.Parameter.KEYWORD_ONLY
    named = [n for n, p in signature.items() if n != "params" and p.kind is not kw]
    assert set(named) == names
    sharding = {"process_group", "bucket_cap_mb", "offload", "overlap_grad_sync", "state_format",
                "overlap_param_sync", "store_param_remainders"}  # fmt: skip
    assert sharding <= {n for n, p in signature.items() if p.kind is kw}
    shown = pydoc.render_doc(zero, renderer=pydoc.plaintext)
    assert all(f"{n}:" in shown.split("Sharding arguments")[1] for n in sharding), shown
    # the param groups get the definition's entries (and FusedX's own, e.g. maximize)
    p = torch.nn.Parameter(torch.ones(2))
    lr = 0.1 if algorithm is sgd else algorithm.Hyperparams.lr
    group_defaults = algorithm.Hyperparams(lr=lr).group_defaults()
    defaults = single([p], lr=lr).defaults
    assert {k: defaults[k] for k in group_defaults} == group_defaults


def test_mixed_precision_lamb_takes_lambs_definition():
    """FusedMixedPrecisionLamb (no ZeRO twin) takes LAMB's defaults plus its own two."""
    params = inspect.signature(FusedMixedPrecisionLamb).parameters
    for f in dataclasses.fields(mixed_precision_lamb.Hyperparams):
        assert params[f.name].default == f.default, f.name
    lamb_fields = {f.name: f.default for f in _fields(lamb)}
    assert {n: params[n].default for n in lamb_fields} == lamb_fields
    assert list(params)[1:3] == ["lr", "step"]  # Apex's positional order


# bad hyperparameters, each applied to every algorithm that has all of its keys
BAD = [
    {"lr": -1.0},
    {"lr": float("nan")},
    {"lr": "0.1"},
    {"lr": torch.tensor([0.1, 0.2])},
    {"eps": -1e-8},
    {"weight_decay": -0.1},
    {"betas": (1.0, 0.999)},
    {"betas": (0.9, -0.1)},
    {"betas": (0.9,)},
    {"bias_correction": (0.9, 0.999)},  # torch's positional order in Apex's
    {"amsgrad": True},
    {"max_grad_norm": -1.0},
    {"norm_type": 1},
    {"momentum": -0.5},
    {"dampening": math.nan},
    {"nesterov": True},  # without momentum
]


def _error(cls, kwargs: dict) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        cls([torch.nn.Parameter(torch.ones(3))], **kwargs)
    return info.type, str(info.value).replace(cls.__name__, "<owner>")


@pytest.mark.parametrize("algorithm, single, zero, _fn, lr", PAIRS, ids=PAIR_IDS)
def test_the_same_bad_hyperparameter_gives_the_same_error(algorithm, single, zero, _fn, lr):
    """Checked before ``torch.distributed`` is needed, so the ZeRO class runs here unlaunched;
    both errors are the definition's ``validate``'s."""
    names = {f.name for f in _fields(algorithm)}
    cases = [bad for bad in BAD if set(bad) <= names]
    if algorithm is sgd:  # lr is required, as torch.optim.SGD's
        cases.append({})
    assert len(cases) >= 5
    for bad in cases:
        kwargs = {"lr": lr, **bad} if "lr" not in bad and bad else dict(bad)
        want_type, want = None, None
        try:
            algorithm.Hyperparams(**kwargs).validate("<owner>")
        except (TypeError, ValueError, RuntimeError) as e:
            want_type, want = type(e), str(e)
        assert want is not None, f"the definition accepts {bad}"
        for cls in (single, zero):
            got = _error(cls, kwargs)
            assert got == (want_type, want), f"{cls.__name__}({bad}): {got}, want {want}"


# -- both classes compute their scalar arguments with the definition's function --------------


def _params() -> list[torch.nn.Parameter]:
    """Large enough that every rank of 3 holds a part of each (a rank with no part of a param
    makes no per-tensor kernel call for it)."""
    return [
        torch.nn.Parameter(torch.linspace(1.0, 2.0, 24 * 16).reshape(24, 16)),
        torch.nn.Parameter(torch.linspace(1.0, 3.0, 500)),
    ]


def _one_step(cls, lr: float, rank: int) -> bool:
    """One step of ``cls`` on a fixed loss; whether any param moved."""
    params = _params()
    opt = cls(params, lr=lr)
    start = [p.detach().clone() for p in params]
    loss = sum((p * torch.linspace(-1.0, 2.0, p.numel()).reshape(p.shape)).sum() for p in params)
    (loss * (rank + 1)).backward()
    opt.step()
    return any(not torch.equal(p.detach(), s) for p, s in zip(params, start))


def _check_one_definition(index: int, rank: int) -> None:
    """Both classes of ``PAIRS[index]`` step with the definition's scalar-argument function:
    patched to hand the kernel lr 0, neither moves a param (unpatched, both do) and both called
    it."""
    algorithm, single, zero, fn_name, lr = PAIRS[index]
    original = getattr(algorithm, fn_name)
    calls: list[str] = []

    def zero_lr(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(fn_name)
        out.pop("lr_t", None)
        out["lr"] = 0.0
        return out

    for cls in (single, zero):
        assert _one_step(cls, lr, rank), f"{cls.__name__} did not step"
        calls.clear()
        setattr(algorithm, fn_name, zero_lr)
        try:
            moved = _one_step(cls, lr, rank)
        finally:
            setattr(algorithm, fn_name, original)
        assert calls, f"{cls.__name__} did not call {algorithm.__name__}.{fn_name}"
        assert not moved, f"{cls.__name__} stepped without {algorithm.__name__}.{fn_name}'s lr"


def one_definition_adam(rank: int, world: int) -> None:
    _check_one_definition(0, rank)


def one_definition_lamb(rank: int, world: int) -> None:
    _check_one_definition(1, rank)


def one_definition_novograd(rank: int, world: int) -> None:
    _check_one_definition(2, rank)


def one_definition_sgd(rank: int, world: int) -> None:
    _check_one_definition(3, rank)


def one_definition_adagrad(rank: int, world: int) -> None:
    _check_one_definition(4, rank)


def lamb_clips_by_one_rule(rank: int, world: int) -> None:
    """LAMB's clipping switch is the definition's ``clips`` in both classes: patched to say
    "off", a step with a tiny ``max_grad_norm`` equals a step with clipping off."""
    original = lamb.clips
    for cls in (FusedLAMB, DistributedFusedLAMB):
        results = []
        for max_grad_norm, patched in ((1e-3, False), (0.0, False), (1e-3, True)):
            params = _params()
            opt = cls(params, lr=0.1, max_grad_norm=max_grad_norm)
            if patched:
                lamb.clips = lambda _max_grad_norm: False
            try:
                loss = sum((p * p.detach() * (rank + 1)).sum() for p in params)
                loss.backward()
                opt.step()
            finally:
                lamb.clips = original
            results.append([p.detach().clone() for p in params])
        clipped, unclipped, patched_run = results
        assert any(not torch.equal(a, b) for a, b in zip(clipped, unclipped)), cls.__name__
        assert all(torch.equal(a, b) for a, b in zip(patched_run, unclipped)), cls.__name__


CASES = [
    one_definition_adam,
    one_definition_lamb,
    one_definition_novograd,
    one_definition_sgd,
    one_definition_adagrad,
    lamb_clips_by_one_rule,
]


@pytest.fixture(scope="module", params=[1, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=240.0, pg_timeout=60.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_both_classes_use_the_one_definition(results, case):
    err = results[case.__name__]
    assert err is None, err
