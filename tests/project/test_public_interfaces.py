"""checkpoint/ and integrations/ use the optimizer's public methods only (docs/design.md): no
attribute access ``x._name`` in them names a private member of ``DistributedOptimizer`` or of
its state-I/O interface."""

from __future__ import annotations

import ast
from pathlib import Path

from shardopt.zero.engine import DistributedOptimizer

PACKAGE = Path(__file__).resolve().parents[2] / "shardopt"


def _private_members() -> set[str]:
    names = set()
    for cls in DistributedOptimizer.__mro__:
        if cls.__module__.startswith("shardopt."):
            names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    return names


def test_checkpoint_and_integrations_use_public_methods_only():
    private = _private_members()
    assert "_build" in private  # (the check sees the engine's private methods)
    found = []
    for folder in ("checkpoint", "integrations"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in private:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
    assert not found, "private optimizer members used:\n" + "\n".join(found)
