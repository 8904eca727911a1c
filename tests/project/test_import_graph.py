"""shardopt's import graph, computed from the sources (every module parsed with ast, imports inside
functions included): no cycle, no module over 500 lines (shardopt/reference.py excepted:
docs/testing.md says why), the kernel layer imports nothing above it, the algorithms (one
definition each, shared by the single-process and the ZeRO classes) import only the kernel layer
below them, and zero/ does not import checkpoint/ (checkpoint/ calls zero's public state I/O,
never the reverse).

Imports under ``if TYPE_CHECKING:`` are edges in both graphs. launch_scripts/ (docs/design.md,
Note: launch_scripts) is also held to: module names are unique across its folders; a module
importing another folder's module puts that folder on sys.path itself; every name imported from a
sibling is defined there."""

from __future__ import annotations

import ast
from pathlib import Path

import shardopt

PACKAGE = Path(shardopt.__file__).resolve().parent
MAX_LINES = 500
# the fp64 reference implementation of every optimizer: one file on purpose (docs/testing.md)
LONG_ON_PURPOSE = {"shardopt.reference"}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_csrc" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The shardopt modules ``name`` imports, at any depth of its code, under
    ``if TYPE_CHECKING:`` too (a dependence for the annotations is still a dependence: no cycle
    hides behind the guard). ``from pkg import x`` is an import of ``pkg.x`` when that is a
    module, else of ``pkg``; a package's parents, which Python initialises first, are not edges
    (a package's __init__ importing its own modules is no cycle)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(_a_cycle(graph, sorted(component)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete cycle through the first module of ``component``, for the failure message."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return path + [start]
        step = next((w for w in nxt if w not in seen), None)
        if step is None:
            return path + [start]
        path.append(step)
        seen.add(step)


def test_the_graph_sees_function_level_imports():
    """The parser is not blind: a known top-level and a known function-level import are edges."""
    assert "shardopt.kernels.loader" in GRAPH["shardopt.kernels.dispatch"]
    assert "shardopt.kernels.custom_ops" in GRAPH["shardopt.kernels.ops"]  # inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_graph_counts_type_checking_imports(tmp_path):
    """An import under ``if TYPE_CHECKING:`` is an edge of shardopt's graph too."""
    path = tmp_path / "guarded.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shardopt.zero.update_calls import Call\n"
    )
    assert "shardopt.zero.update_calls" in _imports("shardopt.zero.guarded", path)


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_500_lines():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in LONG_ON_PURPOSE
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by role): {long}"


def test_the_kernel_layer_imports_nothing_above_it():
    above = (
        "shardopt.algorithms",
        "shardopt.optimizers",
        "shardopt.zero",
        "shardopt.checkpoint",
        "shardopt.integrations",
    )
    for name, deps in GRAPH.items():
        if name.startswith("shardopt.kernels"):
            bad = {d for d in deps if d.startswith(above) or d == "shardopt"}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_algorithms_import_only_the_kernel_layer():
    """shardopt/algorithms/ sits between the kernels and both class families: it may import
    shardopt.kernels and itself, nothing of optimizers/, zero/ or above."""
    assert "shardopt.kernels" in GRAPH["shardopt.algorithms.adam"]  # the rule sees the edges
    for name, deps in GRAPH.items():
        if name.startswith("shardopt.algorithms"):
            bad = {d for d in deps if not d.startswith(("shardopt.kernels", "shardopt.algorithms"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_zero_does_not_import_checkpoint():
    bad = {
        (name, dep)
        for name, deps in GRAPH.items()
        if name.startswith("shardopt.zero")
        for dep in deps
        if dep.startswith("shardopt.checkpoint")
    }
    assert not bad, f"zero/ -> checkpoint/ imports: {sorted(bad)}"


# -- launch_scripts/ ------------------------------------------------------------------------------

SCRIPTS = Path(__file__).resolve().parents[2] / "launch_scripts"


def _script_modules() -> dict[str, Path]:
    """launch_scripts' modules by bare name (how they import each other), in every folder."""
    out: dict[str, Path] = {}
    for path in sorted(SCRIPTS.rglob("*.py")):
        assert path.stem not in out, f"{path} and {out[path.stem]}: one bare name, two modules"
        out[path.stem] = path
    return out


SCRIPT_MODULES = _script_modules()


def _script_imports(path: Path) -> dict[str, set[str]]:
    """The launch_scripts modules ``path`` imports anywhere (at the top, inside functions, under
    ``if TYPE_CHECKING:``), each with the names taken from it (empty for ``import x``)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name.split(".")[0], set())
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.setdefault(node.module, set()).update(a.name for a in node.names)
    return {m: names for m, names in found.items() if m in SCRIPT_MODULES and m != path.stem}


SCRIPT_IMPORTS = {name: _script_imports(path) for name, path in SCRIPT_MODULES.items()}
SCRIPT_GRAPH = {name: set(deps) for name, deps in SCRIPT_IMPORTS.items()}


def _top_level_names(path: Path) -> set[str]:
    """What ``from <module> import name`` can take: the module's top-level definitions."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_the_launch_scripts_graph_counts_type_checking_imports(tmp_path):
    """The stricter parser is not blind: imports in functions and under TYPE_CHECKING are edges."""
    assert {"train_cli", "train_step"} <= SCRIPT_GRAPH["train_gpt"]
    assert "gpt" in SCRIPT_GRAPH["bench_offload_peers"]  # across folders
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from train_cli import OPTIMIZERS\n"
        "def f():\n    import gpt\n"
    )
    assert _script_imports(source) == {"train_cli": {"OPTIMIZERS"}, "gpt": set()}


def test_no_import_cycle_in_launch_scripts():
    cycles = _cycles(SCRIPT_GRAPH)
    assert not cycles, "launch_scripts import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_launch_scripts_imports_across_folders_put_the_folder_on_the_path():
    """A bare-name import of another folder's module works only with that folder on sys.path: the
    importing module inserts it itself (docs/design.md, Note: launch_scripts), whoever imports
    it."""
    missing = []
    for name, deps in SCRIPT_GRAPH.items():
        path = SCRIPT_MODULES[name]
        for dep in deps:
            folder = SCRIPT_MODULES[dep].parent.name
            insert = f'parents[1] / "{folder}"'
            if folder != path.parent.name and insert not in path.read_text():
                missing.append(f"{path.relative_to(SCRIPTS)} imports {dep} ({folder}/)")
    assert not missing, "imports across folders without their sys.path insert:\n" + "\n".join(
        missing
    )


def test_launch_scripts_import_names_their_siblings_define():
    """``from sibling import name``: ``name`` is defined at the top of ``sibling`` (a split that
    moved it leaves the importer failing only when run)."""
    missing = [
        f"{name} imports {sorted(names - defined)} from {dep}"
        for name, imports in SCRIPT_IMPORTS.items()
        for dep, names in imports.items()
        if names - {"*"} - (defined := _top_level_names(SCRIPT_MODULES[dep]))
    ]
    assert not missing, "\n".join(missing)
