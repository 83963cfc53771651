"""pytest plugin: order distributed tests by world size and report what the pools cost.

Enabled for the whole repository through ``-p hp_dtensor.testing.pytest_plugin`` in the root
``pyproject.toml``.
"""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import pool_stats, shutdown_pool


def _world_size(item: pytest.Item) -> int:
    fn = getattr(item, "function", None)
    return int(getattr(fn, "__hp_world_size__", 0))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run single-process tests first, then each world size together (one pool at a time)."""
    items.sort(key=_world_size)


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutdown_pool()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    stats = pool_stats()
    if not stats.starts:
        return
    starts = ", ".join(f"ws={ws}: {sec:.2f} s" for ws, sec in stats.starts)
    terminalreporter.write_line(
        f"hp_dtensor.testing: {stats.jobs} distributed jobs; pool start-ups {starts}; "
        f"rebuilds after failures: {stats.rebuilds}"
    )
