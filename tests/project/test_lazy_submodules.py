"""``import shardopt``, then ``shardopt.checkpoint.save`` or
``shardopt.integrations.accelerate.patch``, works as the docs write it (the subpackages load on
first use), and importing shardopt alone imports no training framework."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_checkpoint_reached_from_the_package():
    out = _run(
        "import shardopt, sys\n"
        "print(callable(shardopt.checkpoint.save), callable(shardopt.checkpoint.load))\n"
        "print(sorted(m for m in ('accelerate', 'transformers', 'lightning') if m in sys.modules))"
    )
    assert out.split("\n")[:2] == ["True True", "[]"], out


@pytest.mark.parametrize("framework, attr", [("accelerate", "patch"), ("transformers", "Trainer")])
def test_integrations_reached_from_the_package(framework, attr):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed (the integrations extra)")
    out = _run(f"import shardopt\nprint(callable(shardopt.integrations.{framework}.{attr}))")
    assert out.strip() == "True", out


def test_unknown_attribute_is_an_attribute_error():
    out = _run(
        "import shardopt\n"
        "for path in ('shardopt.nope', 'shardopt.integrations.nope'):\n"
        "    try:\n"
        "        eval(path)\n"
        "    except AttributeError as e:\n"
        "        print(e)\n"
    )
    assert "has no attribute 'nope'" in out and out.count("\n") == 2, out
