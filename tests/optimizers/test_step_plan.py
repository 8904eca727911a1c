"""Step plans (shardopt/optimizers/step_plan.py): a step that reuses its group's plan gives the
bits of the general path, and every change the plan depends on makes the next step take the
general path (and plan again) instead of reusing stale lists.

Each case steps two identical optimizers on the same grads: ``ours`` keeps its plans, ``twin``
drops them before every step (always the general path); after every step their params and state
must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import shardopt

CLASSES = {
    "FusedAdam": (shardopt.FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    "FusedSGD": (shardopt.FusedSGD, dict(lr=1e-2, momentum=0.9)),
    "FusedAdagrad": (shardopt.FusedAdagrad, dict(lr=1e-2)),
    "FusedLAMB": (shardopt.FusedLAMB, dict(lr=1e-2)),
    "FusedNovoGrad": (shardopt.FusedNovoGrad, dict(lr=1e-2)),
    "FusedMixedPrecisionLamb": (shardopt.FusedMixedPrecisionLamb, dict(lr=1e-2)),
}
NAMES = list(CLASSES)
SHAPES = [(4, 6), (7,), (3, 5, 2), (1,)]


class Pair:
    """``ours`` (plans kept) and ``twin`` (general path every step) on equal params."""

    def __init__(self, name: str, dtype=torch.float32, shapes=SHAPES, **kwargs) -> None:
        cls, defaults = CLASSES[name]
        torch.manual_seed(0)
        start = [torch.randn(s).to(dtype) for s in shapes]
        self.a = [torch.nn.Parameter(t.clone()) for t in start]
        self.b = [torch.nn.Parameter(t.clone()) for t in start]
        self.ours = cls(self.a, **{**defaults, **kwargs})
        self.twin = cls(self.b, **{**defaults, **kwargs})
        self.general: list[int] = []  # groups that took the general path in the last step
        self.seed = 0
        update_group = self.ours._update_group

        def counted(group, params, grads):
            groups = self.ours.param_groups
            self.general.append(next(i for i, g in enumerate(groups) if g is group))
            return update_group(group, params, grads)

        self.ours._update_group = counted

    def step(self, grads=None) -> None:
        self.seed += 1
        torch.manual_seed(self.seed)
        for p, q in zip(self.a, self.b):
            if grads is not None and p in grads:
                g = grads[p]
            else:
                g = torch.randn_like(p) if p.requires_grad else None
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        self.general = []
        self.ours.step()
        self.twin._plans().clear()
        self.twin.step()
        self.check()

    def check(self) -> None:
        for i, (p, q) in enumerate(zip(self.a, self.b)):
            assert p.dtype == q.dtype and torch.equal(p, q), f"param {i}"
            sa, sb = self.ours.state.get(p, {}), self.twin.state.get(q, {})
            assert set(sa) == set(sb), f"state keys of param {i}"
            for key in sa:
                assert torch.equal(sa[key], sb[key]), f"{key} of param {i}"
        for ga, gb in zip(self.ours.param_groups, self.twin.param_groups):
            if torch.is_tensor(ga.get("exp_avg_sq")):
                assert torch.equal(ga["exp_avg_sq"], gb["exp_avg_sq"])

    def warm(self, steps: int = 3) -> None:
        """Steps until the plan is in use (the first steps create state and plan)."""
        for _ in range(steps):
            self.step()
        assert self.general == [], "the plan was not reused"


@pytest.mark.parametrize("name", NAMES)
def test_a_planned_step_equals_the_general_path(name):
    pair = Pair(name)
    pair.warm()
    assert pair.ours._plans().by_group and pair.ours._plans().by_group[0].as_is
    pair.ours.param_groups[0]["lr"] = 0.5 * pair.ours.param_groups[0]["lr"]  # read every step
    pair.twin.param_groups[0]["lr"] = pair.ours.param_groups[0]["lr"]
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_drops_the_plans(name):
    pair = Pair(name)
    pair.warm()
    extra = [torch.randn(3, 3), torch.randn(5)]
    for opt, params in ((pair.ours, pair.a), (pair.twin, pair.b)):
        new = [torch.nn.Parameter(t.clone()) for t in extra]
        params.extend(new)
        opt.add_param_group({"params": new})
    pair.step()
    assert pair.general == [0, 1]
    pair.step()
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_drops_the_plans(name):
    pair = Pair(name)
    pair.warm()
    saved = [pair.ours.state_dict(), pair.twin.state_dict()]
    pair.step()
    for opt, sd in zip((pair.ours, pair.twin), saved):
        opt.load_state_dict(sd)  # back one step: new state tensors
    pair.step()
    assert pair.general == [0]
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_a_grad_that_becomes_none_and_comes_back(name):
    pair = Pair(name)
    pair.warm()
    before = pair.a[1].detach().clone()
    pair.step(grads={pair.a[1]: None})
    assert pair.general == [0] and torch.equal(pair.a[1], before)
    pair.step(grads={pair.a[1]: None})
    assert pair.general == []  # planned without it
    pair.step()
    assert pair.general == [0]
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_a_param_re_bound_through_data(name):
    pair = Pair(name)
    pair.warm()
    fresh = torch.randn(pair.a[0].shape)
    pair.a[0].data = fresh.clone()  # same dtype and layout: the plan holds, the new data moves
    pair.b[0].data = fresh.clone()
    pair.step()
    assert pair.general == [] and not torch.equal(pair.a[0], fresh)
    # another layout (its grads follow it, its state does not): the kernel refuses the planned
    # lists, and _ops passes them through temporaries as the general path does
    bent = torch.randn(2, 5, 3).permute(2, 1, 0)
    pair.a[2].data = bent.clone()
    pair.b[2].data = bent.clone()
    assert pair.a[2].shape == (3, 5, 2) and not pair.a[2].is_contiguous()
    pair.step()
    pair.step()


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB"])
def test_a_param_re_bound_to_another_dtype_with_masters(name):
    pair = Pair(name, dtype=torch.bfloat16, master_weights=True)
    pair.warm()
    for params in (pair.a, pair.b):
        params[1].data = params[1].data.float()  # no master any more: updated directly
    pair.step()
    assert pair.general == [0]
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_a_grad_with_other_strides(name):
    pair = Pair(name)
    pair.warm()
    g = torch.randn(6, 4).t()  # the shape of param 0, column-major
    assert g.shape == pair.a[0].shape and not g.is_contiguous()
    pair.step(grads={pair.a[0]: g})
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_state_written_by_hand(name):
    pair = Pair(name)
    pair.warm()
    key = next(iter(pair.ours.state[pair.a[0]]))
    for opt, params in ((pair.ours, pair.a), (pair.twin, pair.b)):
        opt.state[params[0]][key] = opt.state[params[0]][key].clone()  # a new tensor
    pair.step()
    assert pair.general == [0]
    for opt, params in ((pair.ours, pair.a), (pair.twin, pair.b)):
        opt.state[params[3]] = {k: v.clone() for k, v in opt.state[params[3]].items()}
    pair.step()
    assert pair.general == [0]
    for opt, params in ((pair.ours, pair.a), (pair.twin, pair.b)):
        del opt.state[params[2]]  # the param starts over
    pair.step()
    assert pair.general == [0]
    pair.step()
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_a_param_list_edited_in_place(name):
    pair = Pair(name)
    pair.warm()
    for opt in (pair.ours, pair.twin):
        opt.param_groups[0]["params"].pop(1)
    pair.step()
    assert pair.general == [0]


def test_sgd_momentum_switched_on():
    pair = Pair("FusedSGD", momentum=0.0)
    pair.warm()
    for opt in (pair.ours, pair.twin):
        opt.param_groups[0]["momentum"] = 0.9
    pair.step()
    assert pair.general == [0]
    pair.step()
    pair.step()
    assert pair.general == []


@pytest.mark.parametrize("name", NAMES)
def test_a_group_mixing_dtypes_is_planned_without_as_is(name):
    if name == "FusedMixedPrecisionLamb":
        pair = Pair(name, reduced_precision_dtype=torch.bfloat16)
    else:
        pair = Pair(name)
    for params in (pair.a, pair.b):
        params[1].data = params[1].data.bfloat16()
    pair.warm()
    assert not pair.ours._plans().by_group[0].as_is


@pytest.mark.parametrize("name", NAMES)
def test_a_sparse_grad_after_planning_raises(name):
    pair = Pair(name, shapes=[(5, 3), (4,)])
    pair.warm()
    pair.a[0].grad = torch.randn(5, 3).to_sparse()
    pair.a[1].grad = torch.randn(4)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        pair.ours.step()


def test_capturable_adam_with_a_scaler_reuses_its_plan():
    pair = Pair("FusedAdam", capturable=True)
    for opt in (pair.ours, pair.twin):
        opt.grad_scale = torch.tensor(4.0)
        opt.found_inf = torch.tensor(0.0)
    pair.warm()
    for opt in (pair.ours, pair.twin):
        opt.found_inf = torch.tensor(1.0)  # a skipped step
    pair.step()
    assert pair.general == []


GRAPHED = {
    "FusedAdam": dict(capturable=True, weight_decay=0.01),
    "FusedLAMB": dict(capturable=True),
    "FusedMixedPrecisionLamb": dict(),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(GRAPHED))
def test_a_step_captured_with_forward_and_backward_replays_as_eager(name):
    """docs/api.md "CUDA graphs (single process)": one training iteration captured in a CUDA
    graph after eager warm-up on a side stream; each replay equals an eager iteration."""
    cls = CLASSES[name][0]
    torch.manual_seed(0)
    graphed = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    eager.load_state_dict(graphed.state_dict())
    graphed.cuda(), eager.cuda()
    opts = [
        cls(m.parameters(), lr=torch.tensor(1e-2, device="cuda"), **GRAPHED[name])
        for m in (graphed, eager)
    ]
    batches = [torch.randn(8, 16, device="cuda") for _ in range(8)]
    static_x = batches[0].clone()

    def iteration(model, opt, x):
        model(x).square().mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in batches[:3]:
            opts[0].zero_grad(set_to_none=True)
            static_x.copy_(x)
            iteration(graphed, opts[0], static_x)
    torch.cuda.current_stream().wait_stream(side)
    for x in batches[:3]:
        opts[1].zero_grad(set_to_none=True)
        iteration(eager, opts[1], x)

    graph = torch.cuda.CUDAGraph()
    opts[0].zero_grad(set_to_none=True)  # backward allocates the grads from the graph's pool
    with torch.cuda.graph(graph):
        iteration(graphed, opts[0], static_x)
    for x in batches[3:]:
        static_x.copy_(x)
        graph.replay()
        opts[1].zero_grad(set_to_none=True)
        iteration(eager, opts[1], x)
        torch.cuda.synchronize()
        for a, b in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    steps = [o.param_groups[0]["step"] for o in opts]
    assert torch.is_tensor(steps[0]) and steps[0].item() == steps[1].item() == 8
