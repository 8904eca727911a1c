"""The kernel recipe (docs/kernels.md "Adding an optimizer"), checked: every kernel spec
(shardopt/kernels/specs.py) has a CPU and a CUDA entry point in csrc/ (parsed from the sources:
CUDA is not built everywhere), its C++ declaration in csrc/kernels.def takes the spec's arguments
(names, order, types, defaults, returns), the built module binds exactly the specs' kernels, the
build lists every source, and every custom op passes ``torch.library.opcheck`` on CPU."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from shardopt.kernels import build, custom_ops, loader, ops
from shardopt.kernels.specs import SPECS

CSRC = build.CSRC

# C++ parameter type -> the spec's (torch schema) type
CPP_TYPES = {
    "double": "float",
    "int64_t": "int",  # SymInt in the schema
    "bool": "bool",
    "const at::Tensor&": "Tensor",
    "const OptTensor&": "Optional[Tensor]",
}
CPP_RETURNS = {"void": 0, "TensorPair": 2}


def _kernels_def() -> dict[str, dict]:
    """kernels.def's entries: name -> return type, C++ parameters, Python argument defaults."""
    text = re.sub(r"//[^\n]*", "", (CSRC / "kernels.def").read_text())
    entries = {}
    for m in re.finditer(
        r"SHARDOPT_KERNEL\((\w+),\s*(\w+),\s*\((.*?)\),\s*((?:\"[^\"]*\"\s*)+),(.*?)\)\n",
        text,
        re.S,
    ):
        name, ret, params, _doc, pyargs = m.groups()
        cpp = []
        for p in params.split(","):
            p = " ".join(p.split())
            ptype, pname = p.rsplit(" ", 1)
            cpp.append((pname, ptype))
        defaults = {}
        for a in re.finditer(r"\"(\w+)\"_a(?:\s*=\s*([^,]+))?", pyargs):
            defaults[a.group(1)] = None if a.group(2) is None else a.group(2).strip()
        entries[name] = {"ret": ret, "params": cpp, "pyargs": defaults}
    return entries


DEF = _kernels_def()


def _definitions(backend: str) -> set[str]:
    """Kernel names with a ``<name>_<backend>(`` definition in a source file of that backend."""
    found = set()
    for path in CSRC.rglob(f"*_{backend}.{'cpp' if backend == 'cpu' else 'cu'}"):
        text = path.read_text()
        for name in SPECS:
            # a definition: the name, its parameter list, then the body
            if re.search(rf"\b{name}_{backend}\s*\([^;{{]*\)\s*\{{", text, re.S):
                found.add(name)
    return found


def test_kernels_def_has_exactly_the_specs():
    assert sorted(DEF) == sorted(SPECS)


def test_every_spec_has_a_cpu_and_a_cuda_entry():
    assert _definitions("cpu") == set(SPECS), "kernels without a <name>_cpu definition"
    assert _definitions("cuda") == set(SPECS), "kernels without a <name>_cuda definition"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_matches_the_cpp_declaration(name):
    spec, entry = SPECS[name], DEF[name]
    params = entry["params"]
    first_name, first_type = params[0]
    want_first = "const TensorList&" if spec.flat else "const TensorLists&"
    assert first_type == want_first, f"{name}: its lists are {first_type} in kernels.def"
    rest = [(n, CPP_TYPES[t]) for n, t in params[1:]]
    assert rest == [(n, spec.types[n]) for n in spec.vectors + spec.args], name
    assert CPP_RETURNS[entry["ret"]] == len(spec.returns), name
    # the Python argument names and defaults of the binding are the spec's
    assert list(entry["pyargs"]) == [first_name] + [n for n, _ in rest], name
    for arg, default in entry["pyargs"].items():
        if arg == first_name:
            continue
        if default is None:
            assert arg not in spec.defaults, f"{name}.{arg}: a default in the spec only"
        elif default == "py::none()":
            assert spec.defaults.get(arg, "missing") is None, f"{name}.{arg}"
        else:
            want = {"false": False, "true": True}.get(default, default)
            assert str(spec.defaults.get(arg)) == str(want) or spec.defaults.get(arg) == float(
                want
            ), f"{name}.{arg}: {default} in kernels.def, {spec.defaults.get(arg)} in the spec"


def test_the_module_binds_every_spec():
    for module in {loader.extension(), loader.cpu_extension()}:
        bound = sorted(n for n in dir(module.cpu) if not n.startswith("_"))
        assert bound == sorted(SPECS), module.__name__


def test_build_lists_every_kernel_source():
    """build.py's source stems agree with the files (one math header, one CPU and one CUDA file
    per optimizer stem)."""
    stems = {p.name[: -len("_math.h")] for p in (CSRC / "optim").glob("*_math.h")}
    assert stems - {"math_common"} == set(build.OPTIMIZERS)
    for name in build.OPTIMIZERS:
        assert (CSRC / "optim" / f"{name}_cpu.cpp").is_file()
        assert (CSRC / "optim" / f"{name}_cuda.cu").is_file()
    for name in build.NORM_KERNELS:
        assert (CSRC / "norm" / f"{name}_cpu.cpp").is_file()
        assert (CSRC / "norm" / f"{name}_cuda.cu").is_file()
    cpu = {s.split("/")[-1] for s in build.CPU_SOURCES}
    cuda = {s.split("/")[-1] for s in build.CUDA_SOURCES}
    assert {p.name for p in CSRC.rglob("*_cpu.cpp")} <= cpu
    assert {p.name for p in CSRC.rglob("*_cuda.cu")} <= cuda


@pytest.mark.parametrize("name", sorted(SPECS))
def test_wrapper_signature_is_the_specs(name):
    spec = SPECS[name]
    wrapper = ops._scale if name == "scale" else getattr(ops, name)
    params = list(inspect.signature(wrapper).parameters)
    assert params == ["tensors" if spec.flat else "lists", *spec.vectors, *spec.args, "as_is"]
    assert wrapper.__doc__.startswith(spec.doc)


def test_wrapper_names_a_missing_or_unknown_argument():
    lists = [[torch.ones(2)] for _ in range(3)]
    with pytest.raises(TypeError, match="adagrad\\(\\) missing required arguments: eps"):
        ops.adagrad(lists, lr=0.1, weight_decay=0.0, adagrad_w_mode=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'betas'"):
        ops.adagrad(lists, lr=0.1, eps=1e-8, weight_decay=0.0, adagrad_w_mode=False, betas=1)


def test_positional_and_keyword_calls_agree():
    def run(positional: bool) -> torch.Tensor:
        g, p, s = torch.full((4,), 0.5), torch.ones(4), torch.zeros(4)
        if positional:
            ops.adagrad([[g], [p], [s]], 0.1, 1e-10, 0.0, False)
        else:
            ops.adagrad([[g], [p], [s]], lr=0.1, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False)
        return p

    assert torch.equal(run(True), run(False))


# -- torch.library.opcheck: schema, fake implementation, traced call -------------------------------


def _slots(n: int, dtype=torch.float32) -> list[list[torch.Tensor]]:
    return [[torch.rand(s, dtype=dtype) + 0.5 for s in ((3, 5), (7,))] for _ in range(n)]


def _compact(blockwise: bool) -> list[list[torch.Tensor]]:
    """Compact-state lists: fp32 grads and masters, bf16 (elementwise) or int8 codes with one
    fp32 scale per 256 elements (blockwise)."""
    shapes = ((300,), (7,))
    grads = [torch.rand(s) for s in shapes]
    params = [torch.rand(s) for s in shapes]
    if blockwise:
        m = [torch.randint(0, 256, s, dtype=torch.uint8) for s in shapes]
        v = [torch.randint(0, 256, s, dtype=torch.uint8) for s in shapes]
        scales = [[torch.rand((s[0] + 255) // 256) + 0.1 for s in shapes] for _ in range(2)]
        return [grads, params, [], m, v, *scales]
    m = [torch.rand(s).bfloat16() for s in shapes]
    v = [torch.rand(s).bfloat16() for s in shapes]
    return [grads, params, [], m, v, [], []]


def _cases() -> dict[str, tuple[str, tuple, dict]]:
    g, p, m, v = _slots(4)
    hyper = (0.9, 0.99, 1e-6, 2, True, 0.1)  # beta1, beta2, eps, step, bias_correction, wd
    nv = (0.1, 0.9, 0.99, 1e-8, 2, True, 0.1, True)  # lr, ..., weight_decay, grad_averaging
    adam = (0.1, 0.9, 0.99, 1e-8, 2, True, True, 0.1)
    one = torch.ones(1)
    bf16 = [t.bfloat16() for t in p]
    return {
        "adam": ("adam", (g, p, m, v, [], *adam), {}),
        "adam_out": ("adam", (g, p, m, v, bf16, *adam), {"step_t": one * 2, "lr_t": one * 0.1}),
        "adam_compact": ("adam_compact", (*_compact(False), *adam), {}),
        "adam_blockwise": ("adam_blockwise", (*_compact(True), *adam), {"found_inf_t": one * 0}),
        "sgd": ("sgd", (g, p, m, [], 0.1, 0.9, 0.0, 0.1, False, True, False, 1.0), {}),
        "adagrad": ("adagrad", (g, p, m, [], 0.1, 1e-10, 0.1, False), {}),
        "novograd": (
            "novograd",
            (g, p, m, [], torch.rand(2) + 1, 0.1, 0.9, 0.99, 1e-8, 2, True, 0.1, True, 0),
            {},
        ),
        "novograd_step": (
            "novograd_step",
            (g, p, m, [], torch.rand(2) + 1, None, *nv, 0, 2, False),
            {},
        ),
        "novograd_step_fresh": (
            "novograd_step",
            (g, p, m, bf16, torch.rand(2) + 1, torch.tensor([True, False]), *nv, 1, 0, True),
            {"lr_t": one * 0.1},
        ),
        "lamb_stage1": ("lamb_stage1", (g, p, m, v, *hyper, True, True), {"grad_scale_t": one}),
        "lamb_stage1_clip": (
            "lamb_stage1",
            (g, p, m, v, *hyper, True, True),
            {"grad_scale_t": one * 0.5, "grad_norm_sq_t": one * 9.0, "max_grad_norm": 1.0},
        ),
        "lamb_stage1_fp64": ("lamb_stage1", (*_slots(4, torch.float64), *hyper, True, True), {}),
        "lamb_stage2": (
            "lamb_stage2",
            (p, m, v, [], torch.rand(2) + 1, torch.rand(2) + 1, 0.1, *hyper, True, False),
            {},
        ),
        "lamb_stage2_squared": (
            "lamb_stage2",
            (p, m, v, [], torch.rand(2) + 1, torch.rand(2) + 1, 0.1, *hyper, True, False),
            {"squared": True},
        ),
        "muon_momentum": ("muon_momentum", (g, m, bf16, 0.95, True), {}),
        "muon_momentum_fp32_mix": ("muon_momentum", (g, m, [t.clone() for t in v], 0.9, False), {}),
        "muon_apply": ("muon_apply", (p, bf16, [], 0.02, 0.1, 1.5), {}),
        "muon_apply_out": (
            "muon_apply",
            (p, bf16, [t.clone() for t in bf16], 0.02, 0.1, 1.5),
            {"lr_t": one * 0.02},
        ),  # fmt: skip
        "norm": ("norm", (g, False), {}),
        "norm_fp64_max": ("norm", (_slots(1, torch.float64)[0], True), {}),
        "scale": ("scale", (g, [t.clone() for t in g], 2.0, None, torch.zeros(1)), {}),
    }


CASES = sorted(_cases())


def test_every_op_has_an_opcheck_case():
    assert {op for op, _, _ in _cases().values()} == set(SPECS)
    assert set(custom_ops.OPS) == set(SPECS)


@pytest.mark.parametrize("case", CASES)
def test_custom_op_contract(case):
    """``torch.library.opcheck``: each op's schema, its fake implementation (shapes, dtypes and
    devices of ``lamb_stage1``'s and ``norm``'s sums) and its traced call match the kernel."""
    torch.manual_seed(0)
    name, args, kwargs = _cases()[case]
    torch.library.opcheck(custom_ops.OPS[name], args, kwargs)
