"""Distributed tests as a plan: launches of ``dist_harness.run_cases`` run once per test module.

A plan is a list of ``(world size, cases)`` launches, run in order; later launches read what
earlier ones wrote (a checkpoint saved at world 2 and resumed at 3) in one scratch directory,
whose path the cases find in the environment variable the module names. A module declares its
plan and gets one fixture and one parametrized test, each case reported as its own test:

```text
from dist_plan import plan_fixture, plan_params

ROOT = "SHARDOPT_TEST_MINE_ROOT"  # the cases read os.environ[ROOT]
PLAN = [(2, [save_w2, load_own]), (3, [load_from_w2])]

results = plan_fixture(PLAN, ROOT, timeout=600)

@plan_params(PLAN)
def test_mine(results, world, case):
    results.check(world, case)
```
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dist_harness import Case, run_cases

Plan = list[tuple[int, list[Case]]]


@dataclass
class PlanResults:
    """What a plan's launches reported.

    Attributes:
        root: the scratch directory the plan's cases shared (removed after the module).
        errors: ``{(world size, case name): None, or the first failing rank's traceback}``.
    """

    root: Path
    errors: dict[tuple[int, str], str | None]

    def check(self, world: int, case: Case) -> None:
        """Fails with the case's traceback unless ``case`` passed in its launch at ``world``."""
        err = self.errors[(world, case.__name__)]
        assert err is None, err

    def check_all(self) -> Path:
        """Fails with the first failing case's traceback unless every launch passed; the scratch
        directory (for fixtures that hand what the plan saved to tests of their own)."""
        for (world, name), err in self.errors.items():
            assert err is None, f"{name} (world {world}): {err}"
        return self.root


def _entries(plan: Plan) -> list[tuple[int, Case]]:
    entries = [(world, case) for world, cases in plan for case in cases]
    keys = [(world, case.__name__) for world, case in entries]
    # a repeated (world, name) would report only its last run: an earlier failure would be lost
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    assert not repeated, f"a plan names a case twice at one world size: {repeated}"
    return entries


def plan_fixture(
    plan: Plan, root_env: str, *, name: str = "results", **run_kw: Any
) -> Callable[..., Iterator[PlanResults]]:
    """A module-scoped fixture that runs ``plan`` once and yields its :class:`PlanResults`.

    Args:
        plan: ``(world size, cases)`` launches, run in this order.
        root_env: the environment variable set to the scratch directory while the module runs
            (spawned ranks inherit it).
        name: the fixture's name (assign the result to a module attribute of this name).
        **run_kw: passed to every ``run_cases`` call (``timeout``, ``pg_timeout``,
            ``report_hangs``).
    """
    _entries(plan)

    @pytest.fixture(scope="module", name=name)
    def results() -> Iterator[PlanResults]:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ[root_env] = tmp
            try:
                errors = {}
                for world, cases in plan:
                    for case_name, err in run_cases(cases, world, **run_kw).items():
                        errors[(world, case_name)] = err
                yield PlanResults(Path(tmp), errors)
            finally:
                os.environ.pop(root_env, None)

    return results


def _case_id(value: int | Case) -> str:
    return f"world{value}" if isinstance(value, int) else value.__name__


def plan_params(plan: Plan) -> pytest.MarkDecorator:
    """Parametrizes a test over ``plan``'s ``(world, case)`` pairs, ids ``world2-<case name>``."""
    return pytest.mark.parametrize("world,case", _entries(plan), ids=_case_id)
