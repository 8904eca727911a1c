"""Misuse as a table: (build, expected exception type, message regex)."""

import contextlib
import os
import tempfile
import time

import pytest
import torch
from dist_harness import run_cases

import shardopt
from shardopt import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
    checkpoint,
)
from shardopt import kernels as _ops
from shardopt.zero import comm

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


def test_load_state_dict_of_another_algorithm_is_refused():
    """A stepped torch.optim.SGD's state dict into FusedAdam (and the reverse, and one missing a
    moment): ValueError naming both key sets, and the optimizer's state is left as it was."""
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    adam = FusedAdam(model.parameters(), lr=1e-3)
    adam.step()
    before = adam.state_dict()
    with pytest.raises(ValueError, match=r"'momentum_buffer'.*\['exp_avg', 'exp_avg_sq'\]"):
        adam.load_state_dict(sgd.state_dict())
    after = adam.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-3
    for pid, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][pid][k], v), (pid, k)
    with pytest.raises(ValueError, match=r"'exp_avg'.*\['momentum_buffer'\]"):
        FusedSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(before)
    partial = {"state": {0: {"exp_avg": torch.zeros(2, 3), "step": torch.tensor(1.0)}},
               "param_groups": before["param_groups"]}  # fmt: skip
    with pytest.raises(ValueError, match=r"\['exp_avg_sq'\] missing"):
        FusedAdam(model.parameters()).load_state_dict(partial)
    FusedSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(sgd.state_dict())


# -- distributed misuse (gloo, worlds 1-3): every rank raises, nothing is changed ----------------

PG_TIMEOUT = 30.0  # a collective left by a diverged rank fails after this, not gloo's 30 minutes


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(
        dtype
    )


def _stepped_adam(rank, **kw):
    model = _model()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, **kw)
    model(torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    return model, opt


def _assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, entry in a["state"].items():
        assert entry.keys() == b["state"][pid].keys(), pid
        for k, v in entry.items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)


def dist_foreign_state_dict_refused(rank, world):
    """A stepped torch.optim.SGD's state dict into DistributedFusedAdam: ValueError naming both
    key sets on every rank; nothing loaded (not SGD's lr, no zeroed moments)."""
    model, opt = _stepped_adam(rank)
    sgd_model = _model()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.5, momentum=0.9)
    sgd_model(torch.ones(2, 3)).sum().backward()
    sgd.step()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"'momentum_buffer'.*\['exp_avg', 'exp_avg_sq'\]"):
        opt.load_state_dict(sgd.state_dict())
    _assert_same_state(before, opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.01


def dist_foreign_state_dict_on_one_rank(rank, world):
    """Only the last rank is handed the wrong state dict: it names the keys, every other rank
    raises naming it; no rank loads anything."""
    model, opt = _stepped_adam(rank)
    before = opt.state_dict()
    bad = {
        "state": {0: {"momentum_buffer": torch.zeros(4, 3)}},
        "param_groups": before["param_groups"],
    }
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(bad if rank == world - 1 else before)
    if rank == world - 1:
        assert "'momentum_buffer'" in str(info.value)
    else:
        message = str(info.value)
        assert f"rank {world - 1} failed" in message and "momentum_buffer" in message
    _assert_same_state(before, opt.state_dict())


HYPER_CASES = [
    (shardopt.DistributedFusedAdam, "lr", 1e-3, 2e-3),
    (shardopt.DistributedFusedAdam, "weight_decay", 0.0, 0.1),
    (shardopt.DistributedFusedAdam, "betas", (0.9, 0.999), (0.9, 0.99)),
    (shardopt.DistributedFusedAdam, "eps", 1e-8, 1e-6),
    (shardopt.DistributedFusedAdam, "adam_w_mode", True, False),
    (shardopt.DistributedFusedLAMB, "max_grad_norm", 1.0, 0.5),
    (shardopt.DistributedFusedSGD, "momentum", 0.9, 0.8),
    (shardopt.DistributedFusedAdagrad, "lr", 0.01, torch.tensor(0.02)),
]


def dist_hyperparams_differ_at_construction(rank, world):
    """A hyperparameter that differs on the last rank fails construction on every rank, naming
    the group, the key and both values (at world 1 there is nothing to differ)."""
    for cls, key, value, other in HYPER_CASES:
        kw = {"lr": 0.1} if cls is shardopt.DistributedFusedSGD and key != "lr" else {}
        kw[key] = other if rank == world - 1 and world > 1 else value
        model = _model()
        if world == 1:
            cls(model.parameters(), **kw).close()
            continue
        with pytest.raises(ValueError, match=rf"hyperparameters differ.*group 0 {key}: rank"):
            cls(model.parameters(), **kw)
    # one group of two
    model = _model()
    groups = [
        {"params": model[0].parameters()},
        {"params": model[2].parameters(), "lr": 0.5 if rank == world - 1 else 0.25},
    ]
    if world == 1:
        shardopt.DistributedFusedAdam(groups).close()
    else:
        with pytest.raises(ValueError, match=r"group 1 lr: rank \d has 0\.\d+, rank \d has 0\.\d+"):
            shardopt.DistributedFusedAdam(groups)


def dist_hyperparams_differ_at_load(rank, world):
    """A state dict whose lr (or step) differs on the last rank is refused on every rank; the
    optimizer keeps its state."""
    model, opt = _stepped_adam(rank)
    before = opt.state_dict()
    for key, value in (("lr", 0.5), ("step", 7), ("betas", (0.5, 0.9))):
        sd = opt.state_dict()
        if rank == world - 1:
            sd["param_groups"][0][key] = value
        if world == 1:
            continue
        with pytest.raises(ValueError, match=rf"loaded group hyperparameters.*group 0 {key}"):
            opt.load_state_dict(sd)
        _assert_same_state(before, opt.state_dict())
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.125  # the same on every rank: loads
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.125


def dist_bucket_cap_and_remainders(rank, world):
    """bucket_cap_mb of NaN, inf, <= 0 or not a number, and store_param_remainders=True where
    it would change nothing: a clear error naming the argument, on every rank (also when only
    the last rank passes it)."""
    for bad, exc in ((float("nan"), ValueError), (float("inf"), ValueError), (0, ValueError),
                     (-1.0, ValueError), ("10", TypeError), (None, TypeError)):  # fmt: skip
        with pytest.raises(exc, match=r"bucket_cap_mb"):
            shardopt.DistributedFusedAdam(_model().parameters(), bucket_cap_mb=bad)
        with pytest.raises(exc, match=r"bucket_cap_mb"):
            shardopt.DistributedFusedAdam(
                _model().parameters(), bucket_cap_mb=bad if rank == world - 1 else 1.0
            )
    for dtype, kw in (
        (torch.float32, {}),
        (torch.float16, {}),
        (torch.bfloat16, {"param_sync_dtype": torch.float32}),
    ):
        with pytest.raises(ValueError, match=r"store_param_remainders"):
            shardopt.DistributedFusedAdam(
                _model(dtype).parameters(), store_param_remainders=True, **kw
            )
    model = _model(torch.bfloat16)
    model[2].float()  # bf16 params with remainders next to fp32 params (their own masters)
    opt = shardopt.DistributedFusedAdam(model.parameters(), store_param_remainders=True)
    assert opt.memory_bytes().get("remainder", 0) > 0
    opt.close()


def dist_foreign_keywords_name_their_counterparts(rank, world):
    """A DeepSpeed config key or a ZeroRedundancyOptimizer argument passed as a keyword is a
    TypeError naming shardopt's counterpart; an unknown keyword is a plain one."""
    for kw, counterpart in (
        ({"overlap_comm": True}, "overlap_grad_sync=True, the default"),
        ({"contiguous_gradients": True}, "transient per-bucket buffers"),
        ({"allgather_bucket_size": 5e8}, "bucket_cap_mb"),
        ({"optimizer_class": torch.optim.AdamW}, "ZeroRedundancyOptimizer"),
    ):
        with pytest.raises(TypeError, match=rf"{next(iter(kw))}.*\n.*{counterpart}"):
            shardopt.DistributedFusedAdam(_model().parameters(), **kw)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['colour'\]$"):
        shardopt.DistributedFusedAdam(_model().parameters(), colour=1)


def dist_fsdp2_params_are_refused_with_the_way_out(rank, world):
    """Params sharded by FSDP2's fully_shard (DTensors) kept with a DistributedFused* class: a
    TypeError on every rank naming FSDP2 and the two ways out, not torch's raw error."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    with pytest.raises(TypeError, match=r"DTensor.*fully_shard.*remove fully_shard.*FusedAdam"):
        shardopt.DistributedFusedAdam(model.parameters())


ARRIVAL_S = 3.0  # SHARDOPT_ARRIVAL_TIMEOUT in these cases (default 30 s)


@contextlib.contextmanager
def _arrival_timeout(seconds: float):
    old = os.environ.get(comm.ARRIVAL_TIMEOUT_ENV)
    os.environ[comm.ARRIVAL_TIMEOUT_ENV] = str(seconds)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(comm.ARRIVAL_TIMEOUT_ENV)
        else:
            os.environ[comm.ARRIVAL_TIMEOUT_ENV] = old


def _one_rank_only(call):
    """``call`` on rank 0 only, the other ranks go on to the harness's barrier: rank 0 raises
    within the arrival timeout, naming the call and that it is collective; afterwards every
    rank calling it works (the counts stayed aligned)."""
    model, opt = _stepped_adam(rank := comm.rank(None))
    world = comm.world_size(None)
    with tempfile.TemporaryDirectory() as tmp, _arrival_timeout(ARRIVAL_S):
        path = os.path.join(tmp, "ckpt")
        path = comm.all_gather_object(path, None)[0]  # rank 0's directory
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(comm.CollectiveCallError) as info:
                call(opt, path)
            elapsed = time.monotonic() - start
            assert elapsed < ARRIVAL_S + 2.0, elapsed
            message = str(info.value)
            assert "is collective" in message and "rank 0 called it" in message, message
            assert all(f"rank {r}" in message for r in range(1, world)), message
            assert message.startswith(("DistributedFusedAdam.", "shardopt.checkpoint.")), message
        comm.barrier()
        call(opt, path)  # every rank: works
        comm.barrier()


def _state_dict(opt, path):
    return opt.state_dict()


def _save(opt, path):
    checkpoint.save(path, opt, overwrite=True)


def dist_state_dict_on_one_rank(rank, world):
    if world > 1:
        _one_rank_only(_state_dict)


def dist_save_on_one_rank(rank, world):
    if world > 1:
        _one_rank_only(_save)


def dist_different_collective_calls(rank, world):
    """Rank 0 in checkpoint.save, the others in state_dict(): each side raises at once (well
    before the timeout), naming the call the others wait in."""
    model, opt = _stepped_adam(rank)
    with tempfile.TemporaryDirectory() as tmp, _arrival_timeout(20.0):
        start = time.monotonic()
        if world == 1:
            checkpoint.save(os.path.join(tmp, "c"), opt)
            return
        with pytest.raises(comm.CollectiveCallError) as info:
            if rank == 0:
                checkpoint.save(os.path.join(tmp, "c"), opt)
            else:
                opt.state_dict()
        assert time.monotonic() - start < 10.0
        other = "DistributedFusedAdam.state_dict()" if rank == 0 else "checkpoint.save()"
        assert other in str(info.value), str(info.value)
        comm.barrier()
        assert opt.state_dict()["param_groups"][0]["step"] == 1


DIST_CASES = [
    dist_state_dict_on_one_rank,
    dist_save_on_one_rank,
    dist_different_collective_calls,
    dist_foreign_state_dict_refused,
    dist_foreign_state_dict_on_one_rank,
    dist_hyperparams_differ_at_construction,
    dist_hyperparams_differ_at_load,
    dist_bucket_cap_and_remainders,
    dist_foreign_keywords_name_their_counterparts,
    dist_fsdp2_params_are_refused_with_the_way_out,
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def dist_results(request):
    return run_cases(
        DIST_CASES, request.param, timeout=300.0, pg_timeout=PG_TIMEOUT, report_hangs=True
    )


@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: c.__name__)
def test_distributed_misuse(dist_results, case):
    err = dist_results[case.__name__]
    assert err is None, err


@pytest.mark.parametrize(
    "cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad, FusedMixedPrecisionLamb]
)
def test_every_class_refuses_an_sgd_state_dict(cls):
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    opt = cls(model.parameters())
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=rf"{cls.__name__} keeps \[.*\] per param"):
        opt.load_state_dict(sgd.state_dict())
    assert before and all(torch.equal(opt.state[model.weight][k], v) for k, v in before.items())
    opt.load_state_dict(opt.state_dict())  # its own still loads
