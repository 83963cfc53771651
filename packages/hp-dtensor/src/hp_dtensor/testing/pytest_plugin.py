"""pytest plugin: order distributed tests by world size, report pool costs and test-time budgets.

Enabled for the whole repository through ``-p hp_dtensor.testing.pytest_plugin`` in the root
``pyproject.toml``. Budgets come from the ``HP_TEST_BUDGETS`` environment variable
(``dist=seconds,...``, set by ``scripts/run_tests.py``); a package that spends more than 1.5 times
its budget fails the session.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest

from hp_dtensor.testing import pool_stats, shutdown_pool

#: Overrun factor past which a package's test time fails the session.
BUDGET_TOLERANCE = 1.5

_spent: defaultdict[str, float] = defaultdict(float)


def _world_size(item: pytest.Item) -> int:
    fn = getattr(item, "function", None)
    return int(getattr(fn, "__hp_world_size__", 0))


def _package_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    if parts[0] == "packages" and len(parts) > 1:
        return parts[1]
    return parts[0]


def _budgets() -> dict[str, float]:
    raw = os.environ.get("HP_TEST_BUDGETS", "")
    pairs = (entry.split("=", 1) for entry in raw.split(",") if "=" in entry)
    return {name: float(value) for name, value in pairs}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run single-process tests first, then each world size together (one pool at a time)."""
    items.sort(key=_world_size)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[_package_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pool()
    over = [
        name
        for name, budget in _budgets().items()
        if _spent.get(name, 0.0) > BUDGET_TOLERANCE * budget
    ]
    if over and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    stats = pool_stats()
    if stats.starts:
        starts = ", ".join(f"ws={ws}: {sec:.2f} s" for ws, sec in stats.starts)
        terminalreporter.write_line(
            f"hp_dtensor.testing: {stats.jobs} distributed jobs; pool start-ups {starts}; "
            f"rebuilds after failures: {stats.rebuilds}"
        )
    budgets = _budgets()
    if not budgets:
        return
    terminalreporter.section("test time per package (budget)")
    for name in sorted(set(budgets) | set(_spent)):
        spent, budget = _spent.get(name, 0.0), budgets.get(name)
        if budget is None:
            terminalreporter.write_line(f"{name:16s} {spent:7.1f} s   (no budget)")
            continue
        flag = " OVER BUDGET" if spent > BUDGET_TOLERANCE * budget else ""
        terminalreporter.write_line(f"{name:16s} {spent:7.1f} s / {budget:5.0f} s{flag}")
