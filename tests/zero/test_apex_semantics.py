"""Apex DistributedFusedAdam's remaining semantics and torch.optim's state-dict hooks on the
distributed classes, checked on gloo at worlds 1 and 3 against torch.optim.AdamW (alone, or
under DDP).

- every DistributedFused* class runs the four state-dict hooks with torch.optim's arguments and
  return-value semantics (the log of a hooked torch.optim.AdamW is the reference);
- an integer ``param_sync_dtype`` carries the params' bits: wider, exactly; narrower, rounded to
  nearest even as torch's own casts round (see Note: integer sync in shardopt/zero/sync_bits.py).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_cases
from torch import nn

import shardopt
from shardopt.zero import sync_bits

CLASSES = ("Adam", "LAMB", "NovoGrad", "SGD", "Adagrad")


def _group_lr(group) -> float:
    lr = group["lr"]
    return float(lr.item() if torch.is_tensor(lr) else lr)


def _hook_run(opt, params) -> list:
    """Registers one hook of each kind, steps once, saves and loads twice (the second time with
    the hooks removed); returns what the hooks saw and what came back."""
    log: list = []

    def sd_post(o, sd):
        steps = all("step" in s for s in sd["state"].values())
        log.append(("state_dict post", o is opt, sorted(sd), steps))
        return {**sd, "extra": "from the post-hook"}

    def sd_post_none(o, sd):
        log.append(("state_dict post 2", sd.get("extra")))  # sees the first one's result

    def load_pre(o, sd):
        log.append(("load pre", o is opt, sd.get("extra")))
        sd["mutated"] = True  # a shallow copy: the caller's dict is untouched
        groups = [{**g, "lr": 0.25} for g in sd["param_groups"]]
        return {"state": sd["state"], "param_groups": groups}

    def load_pre_none(o, sd):
        log.append(("load pre 2", "mutated" in sd, _group_lr(sd["param_groups"][0])))

    handles = [
        opt.register_state_dict_pre_hook(lambda o: log.append(("state_dict pre", o is opt))),
        opt.register_state_dict_post_hook(sd_post),
        opt.register_state_dict_post_hook(sd_post_none),
        opt.register_load_state_dict_pre_hook(load_pre),
        opt.register_load_state_dict_pre_hook(load_pre_none),
        opt.register_load_state_dict_post_hook(
            lambda o: log.append(("load post", o is opt, _group_lr(o.param_groups[0])))
        ),
    ]
    gen = torch.Generator().manual_seed(5)
    sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params).backward()
    opt.step()
    sd = opt.state_dict()
    log.append(("returned", sd.get("extra")))
    opt.load_state_dict(sd)
    log.append(("caller's dict untouched", "mutated" not in sd))
    log.append(("loaded lr", _group_lr(opt.param_groups[0])))
    for h in handles:
        h.remove()
    log.append(("without hooks", "extra" in opt.state_dict()))
    opt.load_state_dict(sd)
    log.append(("lr after hookless load", _group_lr(opt.param_groups[0])))
    return log


def state_dict_hooks_as_torch(rank, world):
    """Every DistributedFused* class runs torch.optim's four state-dict hooks as AdamW does:
    arguments, a post-hook's returned dict replacing the state dict, a load pre-hook working on
    a shallow copy and its returned dict being loaded, a None return keeping the dict."""
    torch.manual_seed(0)
    theirs = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(5))]
    want = _hook_run(torch.optim.AdamW(theirs, lr=1e-2), theirs)
    assert want == [
        ("state_dict pre", True),
        ("state_dict post", True, ["param_groups", "state"], True),
        ("state_dict post 2", "from the post-hook"),
        ("returned", "from the post-hook"),
        ("load pre", True, "from the post-hook"),
        ("load pre 2", False, 0.25),
        ("load post", True, 0.25),
        ("caller's dict untouched", True),
        ("loaded lr", 0.25),
        ("without hooks", False),
        ("lr after hookless load", 0.01),
    ]
    for name in CLASSES:
        torch.manual_seed(0)
        ours = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(5))]
        cls = getattr(shardopt, f"DistributedFused{name}")
        got = _hook_run(cls(ours, lr=1e-2), ours)
        assert got == want, (name, got, want)


def init_params_dtypes_refused_on_every_rank(rank, world):
    """Per-param dtypes that cannot be honoured raise on every rank, never hang: after the first
    backward, a dtype that is no sync dtype, ranks asking for different dtypes; the optimizer
    keeps working afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2)
    first = list(model[0].parameters())
    with pytest.raises(TypeError, match="param_sync_dtype"):
        opt.init_params(first, param_sync_dtype=torch.complex64 if rank == 0 else None)
    with pytest.raises(ValueError, match="not one of this optimizer's params"):
        opt.init_params([torch.zeros(3)] if rank == 0 else first)
    with pytest.raises(NotImplementedError, match="state dtype is set per optimizer"):
        opt.init_params(first, dtype=torch.bfloat16 if rank == world - 1 else None)
    if world > 1:
        with pytest.raises(ValueError, match="differ between ranks"):
            dtype = torch.bfloat16 if rank == 0 else torch.float16
            opt.init_params(first, grad_sync_dtype=dtype)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        opt.init_params(first, grad_sync_dtype=torch.bfloat16)
    opt.step()
    assert {k.buffers.grad_dtype for k in opt.keys} == {torch.float32}


CASES = [state_dict_hooks_as_torch, init_params_dtypes_refused_on_every_rank]


@pytest.fixture(scope="module", params=[1, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=400.0, pg_timeout=30.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_apex_semantics(results, case):
    assert results[case.__name__] is None, results[case.__name__]


# tests/zero/apex_script.py's cases of these semantics at world 1 (test_apex_compat.py runs them at
# worlds 2 and 3)
SCRIPT_CASES = (
    "scaled_states_with_int32_sync",
    "uint8_sync_with_fp16_state",
    "multi_dtype_init_params",
)


@pytest.fixture(scope="module")
def script_results():
    import apex_script

    cases = [c for c in apex_script.CASES if c.__name__ in SCRIPT_CASES]
    return run_cases(cases, 1, timeout=400.0, pg_timeout=30.0)


@pytest.mark.parametrize("name", SCRIPT_CASES)
def test_apex_script_case_at_world_1(script_results, name):
    assert name in script_results, sorted(script_results)
    assert script_results[name] is None, script_results[name]


# -- integer param sync: the bits carried ------------------------------------------------------


def _values():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(20000, generator=gen) * torch.logspace(-6, 4, 20000)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0, 65504.0, 1e-7])
    return torch.cat([v, ties, torch.tensor([float("inf"), -float("inf")])])


@pytest.mark.parametrize(
    "param_dtype, sync_dtype",
    [
        (torch.bfloat16, torch.int32),
        (torch.bfloat16, torch.int64),
        (torch.float16, torch.int32),
        (torch.float32, torch.int64),
        (torch.float64, torch.int64),
    ],
)
def test_wider_integer_sync_carries_the_params_bits(param_dtype, sync_dtype):
    """Wider than the param: the param's bits in the top bytes, the rest zero; the params get
    exactly the master rounded to their dtype (as gathering in their dtype)."""
    master = _values()
    sync = torch.empty(master.numel(), dtype=sync_dtype)
    sync_bits.write_sync(sync, master, param_dtype)
    size = torch.empty((), dtype=param_dtype).element_size()
    raw = sync.view(torch.uint8).view(-1, sync.element_size())
    assert not raw[:, : sync.element_size() - size].any()
    params = torch.empty(master.numel(), dtype=param_dtype)
    sync_bits.sync_to_params(params, sync)
    assert torch.equal(params, master.to(param_dtype))


@pytest.mark.parametrize(
    "param_dtype, sync_dtype, torch_format",
    [(torch.float16, torch.uint8, torch.float8_e5m2), (torch.float32, torch.int16, torch.bfloat16)],
)
def test_narrower_integer_sync_rounds_as_torch(param_dtype, sync_dtype, torch_format, monkeypatch):
    """Narrower than the param: the top bytes hold the value rounded to nearest even, what
    torch's cast to that format gives, both through torch's cast and through the bit rounding
    used for formats torch lacks (bf16 or fp32 params in uint8)."""
    master = _values()
    want = master.to(param_dtype).to(torch_format).to(param_dtype)
    for fmt in (sync_bits._TORCH_FORMAT, {}):
        monkeypatch.setattr(sync_bits, "_TORCH_FORMAT", fmt)
        sync = torch.empty(master.numel(), dtype=sync_dtype)
        sync_bits.write_sync(sync, master.to(param_dtype).float(), param_dtype)
        params = torch.empty(master.numel(), dtype=param_dtype)
        sync_bits.sync_to_params(params, sync)
        assert torch.equal(params, want), fmt
