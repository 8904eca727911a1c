"""Shared fixtures and the parity harness: a fused optimizer against the fp64 reference.

``run_vs_reference`` builds a fused optimizer and its ``shardopt.reference`` twin on the same start
values, feeds both the same fresh random grads (the reference gets them upcast to fp64) and checks
params, fp32 masters and per-element state after every step with docs/spec.md's tolerances.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import pytest
import torch

from shardopt import FusedSGD
from shardopt import kernels as _ops

CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_MARKS)]

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float64, id="fp64"),
]
LOW_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]

# docs/spec.md "Test tolerances": (rtol, atol) of a param of this dtype vs the fp64 reference.
# fp64 kernels do fp64 math: 1e-8 is far below one fp32 rounding (6e-8), so an fp32 path shows.
TOLERANCES = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (5e-3, 1e-5),
    torch.bfloat16: (5e-2, 1e-5),
    torch.float64: (1e-8, 1e-10),
}

SMALL_SHAPES = [(3, 5), (7,), (1,), (2, 3, 4)]
# (size, dtype) cases of the odd-size tests: every dtype on the small ones, fewer on the slow ones
SIZE_CASES = [
    pytest.param(size, dtype, id=f"{size}-{name}")
    for size, dtypes in [
        ("one", DTYPES),
        ("seven", DTYPES),
        ("chunk_boundary", DTYPES),
        ("many_tiny", [DTYPES[0], DTYPES[2]]),
        ("large", [DTYPES[0]]),
    ]
    for dtype, name in ((d.values[0], d.id) for d in dtypes)
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every test taking ``device`` runs on cpu, and on cuda when a GPU is present."""
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


def skip_unsupported(dtype: torch.dtype, device: torch.device) -> None:
    """fp64 params are a CPU option only (docs/spec.md: shared rules, dtypes)."""
    if dtype == torch.float64 and device.type != "cpu":
        pytest.skip("fp64 params are supported on CPU only")


def shapes_for(size: str, device: torch.device) -> list[tuple[int, ...]]:
    """The odd sizes every kernel is checked on (STYLE: parity is the definition of correct)."""
    if size == "one":
        return [(1,)]
    if size == "seven":
        return [(7,)]
    if size == "large":
        return [(278011,)]
    if size == "chunk_boundary":
        return [(_ops.chunk_size(device) + 5,), (3,)]
    if size == "many_tiny":
        gen = torch.Generator().manual_seed(1)
        return [(int(n),) for n in torch.randint(1, 5, (300,), generator=gen)]
    raise ValueError(size)


def make_tensors(shapes, dtype: torch.dtype, device: torch.device, std: float = 1.0) -> list:
    """Random tensors drawn in fp32 on the CPU (same values on every device), cast to ``dtype``."""
    return [(torch.randn(s) * std).to(dtype).to(device) for s in shapes]


def make_params(shapes, dtype: torch.dtype, device: torch.device) -> list:
    """Random params with |p| >= 1: a low-precision param crossing zero rounds its intermediate
    values at their ulp, not the final one's, which docs/spec.md's fixed atol does not allow."""
    out = []
    for s in shapes:
        x = torch.randn(s)
        out.append((torch.where(x < 0, -1.0, 1.0) + x).to(dtype).to(device))
    return out


def assert_close_to(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, atol: float | None = None
) -> None:
    rtol, default_atol = TOLERANCES[dtype]
    atol = default_atol if atol is None else atol
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape == want.shape and bool(((got - want).abs() <= atol + rtol * want.abs()).all()):
        return  # the fast path; assert_close below explains a failure (and checks nan/inf)
    torch.testing.assert_close(
        got,
        want,
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )


def _ref_kwargs(ref_cls, kw: dict) -> dict:
    accepted = inspect.signature(ref_cls.__init__).parameters
    return {k: v for k, v in kw.items() if k in accepted}


class Parity:
    """A fused optimizer and its fp64 reference twin, stepped together."""

    def __init__(
        self,
        fused_cls,
        ref_cls,
        shapes: Sequence,
        dtype: torch.dtype,
        device: torch.device,
        *,
        group_options: Sequence[dict] | None = None,
        params: list[torch.Tensor] | None = None,
        grad_std: float = 1.0,
        compare_as: torch.dtype | None = None,
        **kw,
    ) -> None:
        self.dtype, self.device, self.grad_std = dtype, torch.device(device), grad_std
        # the dtype whose tolerance applies (looser than ``dtype`` only for a documented deviation)
        self.tol = compare_as or dtype
        grouped = [list(s) for s in shapes] if group_options is not None else [list(shapes)]
        options = list(group_options) if group_options is not None else [{}]
        if params is None:
            params = make_params([s for g in grouped for s in g], dtype, self.device)
        self.params = params
        self.start = [p.detach().clone() for p in params]
        fused_groups, ref_groups, i = [], [], 0
        for g, opts in zip(grouped, options, strict=True):
            ps = params[i : i + len(g)]
            i += len(g)
            fused_groups.append({"params": ps, **opts})
            ref_groups.append({"params": [p.detach().cpu() for p in ps], **opts})
        self.opt = fused_cls(fused_groups, **kw)
        self.ref = ref_cls(ref_groups, **_ref_kwargs(ref_cls, kw))

    def grads(self, skip: Callable[[int], bool] = lambda i: False) -> list:
        """Fresh random grads in the param dtype (None where ``skip(index)``)."""
        return [
            None if skip(i) else (torch.randn(p.shape) * self.grad_std).to(p.dtype).to(p.device)
            for i, p in enumerate(self.params)
        ]

    def step(self, grads: list | None = None, **ref_step_kw) -> list:
        grads = self.grads() if grads is None else grads
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        self.opt.step()
        self.ref.step([None if g is None else g.cpu().double() for g in grads], **ref_step_kw)
        return grads

    def check(self, *, master: bool = False, state_keys: Sequence[str] = ()) -> None:
        """Params at their dtype's tolerance; masters and state (kept in fp32) likewise."""
        for i, (p, r) in enumerate(zip(self.params, self.ref.params(), strict=True)):
            assert p.dtype == self.dtype and p.device == self.device
            assert_close_to(p, r, self.tol, f"param {i}")
            state = self.opt.state.get(p, {})
            if master:
                m = state["master_param"]
                assert m.dtype == torch.float32
                assert_close_to(m, r, torch.float32, f"master of param {i}")
            for key in state_keys:
                if key not in self.ref.state.get(i, {}):
                    assert key not in state, f"param {i} has {key} but its reference has none"
                    continue
                acc = torch.float64 if self.dtype == torch.float64 else torch.float32
                # docs/spec.md "State dtypes": FusedSGD's buffer has the param's dtype
                kept = self.dtype if isinstance(self.opt, FusedSGD) else acc
                assert state[key].dtype == kept, f"{key} of param {i} is {state[key].dtype}"
                want = self.ref.state[i][key]
                if master or self.dtype not in (torch.float16, torch.bfloat16):
                    tol = self.tol if self.tol != self.dtype else acc
                    assert_close_to(state[key], want, tol, f"{key} of param {i}")
                else:
                    # fp32 state fed by a rounded param: errors scale with the state, not each
                    # entry; state in the param dtype rounds every op: errors scale with the
                    # grad-sized terms summed into it, even where they cancel
                    scale = float(want.abs().max())
                    if kept != acc:
                        scale = max(scale, self.grad_std)
                    atol = TOLERANCES[self.dtype][0] * scale
                    assert_close_to(state[key], want, self.dtype, f"{key} of param {i}", atol)

    def assert_moved(self) -> None:
        """Guards against a vacuous comparison (e.g. an update below the param's precision)."""
        moved = any(not torch.equal(p, s) for p, s in zip(self.params, self.start, strict=True))
        assert moved, "no param changed: the comparison would be vacuous"


def run_vs_reference(
    fused_cls,
    ref_cls,
    shapes: Sequence,
    dtype: torch.dtype,
    device: torch.device,
    steps: int = 4,
    *,
    skip: Callable[[int, int], bool] | None = None,
    master: bool = False,
    state_keys: Sequence[str] = (),
    **kw,
) -> Parity:
    """Steps fused and reference optimizers ``steps`` times and checks them after every step.

    ``skip(step, index)`` True gives that param no grad on that step. Other keyword arguments go to
    both constructors (the reference ignores the ones it does not know), plus ``group_options``,
    ``params`` and ``grad_std`` for :class:`Parity`.
    """
    run = Parity(fused_cls, ref_cls, shapes, dtype, device, **kw)
    for t in range(steps):
        run.step(run.grads((lambda i, t=t: skip(t, i)) if skip else (lambda i: False)))
        run.check(master=master, state_keys=state_keys)
    run.assert_moved()
    return run


def init_scaler(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """GradScaler creates its scale lazily in ``scale()``; do that once."""
    scaler.scale(torch.ones((), device=device))


def scaled_step(scaler, opt, params: list, grads: list) -> None:
    """Hands ``grads`` to ``opt`` loss-scaled by ``scaler`` (as backward on a scaled loss would)."""
    scale = scaler.get_scale()
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else (g.float() * scale).to(p.dtype)
    scaler.step(opt)
    scaler.update()


# torch.amp.GradScaler's own inf check has no CUDA kernel for bf16 grads (a torch limitation), so
# GradScaler tests pair bf16 with the CPU only.
SCALER_CASES = [
    pytest.param(dtype, dev, id=f"{dev}-{name}", marks=CUDA_MARKS if dev == "cuda" else [])
    for dev in ("cpu", "cuda")
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16"))
    if not (dev == "cuda" and dtype == torch.bfloat16)
]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` are the long mode: they run only when ``-m`` names them (``pytest -m
    slow``; ``-m "slow or not slow"`` for everything). CI's ``-m "not cuda and not multigpu"``
    leaves them out."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if "slow" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "slow" in i.keywords])
        items[:] = kept
