"""pytest plugin: order distributed tests by world size, report pool costs and test-time budgets.

Enabled for the whole repository through ``-p hp_dtensor.testing.pytest_plugin`` in the root
``pyproject.toml``. Budgets come from the ``HP_TEST_BUDGETS`` environment variable
(``dist=seconds,...``, set by ``scripts/run_tests.py``). A budget is a warning, never a failure:
elapsed time depends on the machine's load, so a package over its budget is reported (with its
slowest tests) and the session's exit code is left to the tests themselves.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from hp_dtensor.testing import pool_stats, run_distributed, shutdown_pool, start_fork_server

#: Number of slowest tests listed for a package over its budget.
SLOWEST_SHOWN = 5

_spent: defaultdict[str, float] = defaultdict(float)
_durations: defaultdict[str, list[tuple[float, str]]] = defaultdict(list)
_cpu: defaultdict[str, float] = defaultdict(float)
_cpu_per_test: list[tuple[float, str]] = []


def _cpu_seconds() -> float:
    """CPU time so far of this process, its pool workers' jobs and its waited-for subprocesses."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + pool_stats().worker_cpu_s + children.ru_utime + children.ru_stime


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


def _uses_pools(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return _world_size(item) > 0 or getattr(module, "run_distributed", None) is run_distributed


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the workers' fork server as soon as the tests are known, if any uses a pool.

    Its imports (torch, the stack, what ``preload_in_workers`` names: several CPU seconds) then
    run beside the single-process tests, which come first and leave a core idle, instead of
    holding up the first distributed test.
    """
    if any(_uses_pools(item) for item in session.items):
        start_fork_server()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    package = _package_of(report.nodeid)
    _spent[package] += report.duration
    _durations[package].append((report.duration, f"{report.nodeid} ({report.when})"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Charge each test's CPU seconds (all processes) to its package: a figure the load of the
    machine hardly changes, unlike the elapsed time the budgets are in."""
    before = _cpu_seconds()
    yield
    spent = _cpu_seconds() - before
    _cpu[_package_of(item.nodeid)] += spent
    _cpu_per_test.append((spent, item.nodeid))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pool()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    stats = pool_stats()
    if stats.starts:
        sizes = sorted({ws for ws, _ in stats.starts})
        per_size = ", ".join(f"ws={n}: {sum(w == n for w, _ in stats.starts)}" for n in sizes)
        total = sum(sec for _, sec in stats.starts)
        terminalreporter.write_line(
            f"hp_dtensor.testing: {stats.jobs} distributed jobs; {len(stats.starts)} pool "
            f"start-ups ({per_size}) in {total:.1f} s; "
            f"rebuilds after failures: {stats.rebuilds}; "
            f"pools replaced for leaked gloo threads: {stats.renewals}; "
            f"worker CPU {stats.worker_cpu_s:.1f} s; DTensor caches kept after "
            f"{stats.caches_kept} jobs, cleared after {stats.caches_cleared}; "
            f"sharding propagations computed (rank 0) {stats.sharding_propagations}"
        )
        if stats.clear_reasons:
            common = sorted(stats.clear_reasons.items(), key=lambda kv: -kv[1])[:3]
            terminalreporter.write_line(
                "DTensor caches cleared after: " + "; ".join(f"{n}x {why}" for why, n in common)
            )
    budgets = _budgets()
    if not budgets:
        return
    terminalreporter.section("test time per package (budget), and CPU seconds of all processes")
    for name in sorted(set(budgets) | set(_spent)):
        spent, budget = _spent.get(name, 0.0), budgets.get(name)
        cpu = f"   CPU {_cpu.get(name, 0.0):7.1f} s"
        if budget is None:
            terminalreporter.write_line(f"{name:16s} {spent:7.1f} s   (no budget){cpu}")
            continue
        flag = "   WARNING: over budget (not a failure)" if spent > budget else ""
        terminalreporter.write_line(f"{name:16s} {spent:7.1f} s / {budget:5.0f} s{cpu}{flag}")
        if flag:
            for duration, nodeid in sorted(_durations[name], reverse=True)[:SLOWEST_SHOWN]:
                terminalreporter.write_line(f"    {duration:6.1f} s  {nodeid}")
    terminalreporter.write_line(f"most CPU seconds (all processes), top {SLOWEST_SHOWN * 2}:")
    for spent, nodeid in sorted(_cpu_per_test, reverse=True)[: SLOWEST_SHOWN * 2]:
        terminalreporter.write_line(f"    {spent:6.1f} s  {nodeid}")
