"""torch.compile (docs/integrations.md): every single-process optimizer's ``step()`` compiles
with ``fullgraph=True`` (its kernels are ``torch.library`` custom ops,
shardopt/kernels/custom_ops.py) and equals the eager step; at world 2 (gloo) a compiled model
trained with DistributedFusedAdam, and a compiled function holding the whole training step, equal
the eager run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import assert_close_to
from dist_harness import run_cases
from torch._dynamo.utils import counters

import shardopt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.a = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.b = nn.Linear(16, 11)

    def forward(self, idx):
        return self.b(self.ln(torch.relu(self.a(self.emb(idx)))))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def _train(compiled: bool, rank: int, backend: str = "aot_eager", warm: bool = False, **kw):
    """Three steps of 2 micro-batches (the first in ``no_sync``) with clipping; ``warm``: the
    compiled model runs once before the optimizer (and its hooks) exists."""
    torch._dynamo.reset()
    model = Net()
    fwd = torch.compile(model, backend=backend) if compiled else model
    if warm:
        fwd(_batch(99, rank))
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for step in range(3):
        idx = _batch(step, rank)
        for micro in range(2):
            loss = _loss(fwd(idx), idx) / 2
            if micro == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    opt.wait_param_sync()
    return [p.detach().clone() for p in model.parameters()]


def compiled_equals_eager(rank, world):
    eager = _train(False, rank)
    for backend in ("aot_eager",):  # inductor passes too (+30 s of compiling on 2 cores)
        got = _train(True, rank, backend)
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=backend)


def warm_compiled_overlap_equals_eager(rank, world):
    """A model compiled before the optimizer exists has no param-sync hooks in its graph: with
    ``overlap_param_sync`` the wait on the ``torch.compile`` wrapper's call keeps its forward from
    reading params while their all-gathers are in flight (several buckets)."""
    kw = dict(overlap_param_sync=True, bucket_cap_mb=0.0005)
    eager = _train(False, rank, **kw)
    got = _train(True, rank, warm=True, **kw)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _train_step_fn(compiled: bool, rank: int):
    """Forward, backward, clipping, step and zero_grad in one function, compiled as a whole."""
    torch._dynamo.reset()
    counters.clear()
    model = Net()
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train_step(idx):
        loss = _loss(model(idx), idx)
        loss.backward()  # runs the grad hooks (Dynamo must not trace them)
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    fn = torch.compile(train_step, backend="aot_eager") if compiled else train_step
    losses = [fn(_batch(step, rank)) for step in range(3)]
    return [p.detach().clone() for p in model.parameters()] + losses, dict(counters["graph_break"])


def compiled_train_step_equals_eager(rank, world):
    """The graph breaks are torch's at ``backward()`` and one per call into the engine (all
    ``torch.compiler.disable``d: see Note: torch.compile in shardopt/zero/engine.py); nothing of
    shardopt is traced, and weights and losses are the eager ones."""
    eager, _ = _train_step_fn(False, rank)
    got, breaks = _train_step_fn(True, rank)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for reason in breaks:
        assert "backward()" in reason or "torch.compiler.disable()" in reason, reason


DIST_CASES = [
    compiled_equals_eager,
    warm_compiled_overlap_equals_eager,
    compiled_train_step_equals_eager,
]


@pytest.fixture(scope="module")
def dist_results():
    return run_cases(DIST_CASES, 2, timeout=400)


@pytest.mark.parametrize("case", [c.__name__ for c in DIST_CASES])
def test_distributed_adam_compiled(dist_results, case):
    assert dist_results[case] is None, dist_results[case]


# every single-process class: (constructor arguments, those that add fp32 masters to bf16 params)
SINGLE = {
    "FusedAdam": (dict(lr=0.1, weight_decay=0.1), dict(master_weights=True)),
    "FusedSGD": (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), {}),
    "FusedAdagrad": (dict(lr=0.1, weight_decay=0.1), {}),
    "FusedLAMB": (dict(lr=0.1, weight_decay=0.1, max_grad_norm=0.5), dict(master_weights=True)),
    "FusedNovoGrad": (dict(lr=0.1, weight_decay=0.1), {}),
    "FusedMixedPrecisionLamb": (
        dict(lr=0.1, max_grad_norm=0.5),
        dict(reduced_precision_dtype=torch.bfloat16),
    ),
}


def _compiled_vs_eager(name, device, dtype, backend, steps=3):
    """One compiled (``fullgraph=True``, state created inside the first compiled step) and one
    eager optimizer of class ``name`` on twin two-group models, stepped together; params and
    per-element state must agree after every step, with no graph break and no recompile per
    step."""
    counters.clear()
    torch._dynamo.reset()
    kw, masters = SINGLE[name]
    kw = {**kw, **(masters if dtype != torch.float32 else {})}
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device, dtype)
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}]
        models.append(model)
        opts.append(getattr(shardopt, name)(groups, **kw))

    def step(opt):
        opt.step()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for _ in range(steps):
        x = torch.randn(2, 4).to(device, dtype)
        for model in models:
            model(x).float().square().sum().backward()
        compiled(opts[0])
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
        got, want = ([p for g in opt.param_groups for p in g["params"]] for opt in opts)
        state_tol = torch.float32 if dtype == torch.float32 else dtype  # fed by rounded params
        for i, (p, q) in enumerate(zip(got, want)):
            assert_close_to(p, q, dtype, f"param {i}")
            assert opts[0].state[p].keys() == opts[1].state[q].keys()
            for key, value in opts[1].state[q].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    assert_close_to(opts[0].state[p][key], value, state_tol, f"{key} of {i}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the first step creates the state, the second makes the step count dynamic; no more
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("name", list(SINGLE))
def test_fused_step_compiles_fullgraph(name):
    """``opt.step()`` of every single-process class compiles with ``fullgraph=True`` (every kernel
    is a custom op) and updates params and state as the eager step does (fp32, CPU)."""
    _compiled_vs_eager(name, torch.device("cpu"), torch.float32, "aot_eager")


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedNovoGrad"])
def test_tensor_lr_is_read_on_the_device(name):
    """A tensor lr (non-capturable) is read by the kernels on the device: the step equals the
    float-lr step, a scheduler's write into the tensor takes effect, and a compiled step neither
    breaks the graph nor recompiles when the lr changes."""
    counters.clear()
    torch._dynamo.reset()
    kw = {k: v for k, v in SINGLE[name][0].items() if k != "lr"}
    models, opts = [], []
    lr = torch.tensor(0.1)
    for i in range(3):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
        cls = getattr(shardopt, name)
        opts.append(cls(models[-1].parameters(), lr=0.1 if i == 0 else lr, **kw))

    def step(opt):
        opt.step()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for k in range(4):
        value = 0.1 / (k + 1)  # a scheduler: the float group is set, the tensor written in place
        opts[0].param_groups[0]["lr"] = value
        lr.fill_(value)
        x = torch.randn(2, 4)
        for model in models:
            model(x).square().sum().backward()
        opts[0].step()
        opts[1].step()
        compiled(opts[2])
        for opt in opts:
            opt.zero_grad()
        for a, b, c in zip(*(m.parameters() for m in models)):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb"])
def test_fused_step_with_fp32_masters_compiles_fullgraph(name):
    """bf16 params with fp32 masters (CPU, aot_eager): the eager step's check of the params'
    version counters (masters follow writes into params) stays out of the compiled step."""
    _compiled_vs_eager(name, torch.device("cpu"), torch.bfloat16, "aot_eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(SINGLE))
def test_fused_step_compiles_fullgraph_cuda_bf16(name):
    """The same on CUDA with bf16 params (fp32 masters where the class keeps them), inductor."""
    _compiled_vs_eager(name, torch.device("cuda"), torch.bfloat16, "inductor")


def test_mixed_group_capturable_grad_scale_compiles():
    """A group mixing bf16 params (fp32 masters) with fp32 ones, a capturable step with a tensor lr
    and GradScaler's hand-off (grads unscaled in place by ``shardopt::scale``): compiled equals
    eager."""
    torch._dynamo.reset()
    counters.clear()
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8).to(torch.bfloat16), nn.Linear(8, 3))
        models.append(model)
        opts.append(
            shardopt.FusedAdam(
                model.parameters(), lr=torch.tensor(0.1), master_weights=True, capturable=True
            )
        )

    def step(opt):
        opt.step()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(2, 4)
        for model, opt in zip(models, opts):
            (model[1](model[0](x.bfloat16()).float()).sum() * 4).backward()
            opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        compiled(opts[0])
        opts[1].step()
        for a, b in zip(*(m.parameters() for m in models)):
            assert_close_to(a, b, a.dtype, "param")
    assert not counters["graph_break"], dict(counters["graph_break"])
