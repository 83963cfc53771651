"""hp-trainer's tests run grouped by world size, so each warm worker pool is started once.

``hp_dtensor.testing``'s pytest plugin sorts tests by the world size of
``@distributed(world_size=N)``; most trainer tests call ``run_distributed(fn, N, ...)`` instead,
with ``N`` a literal, a parameter, or a name unpacked from a parameter's table row. Run in file
order, the suite switched pools 29 times, and every switch imports hp-trainer again on every
rank of the new pool (3-8 s each on a loaded 2-core machine). This hook reads each test's own
``run_distributed`` calls (``ast``; only names, constants and subscripts are evaluated, never a
call) and sorts by ``(first world size, last world size)`` after the plugin's sort: a test that
uses several pools (2 then 3) goes last among the 2s, so the 3s continue on its pool. A test
whose world size cannot be read keeps the plugin's key; the order inside a world size is the
collection order (the sort is stable).

A test's own ``run_distributed`` calls win over a declared ``__hp_world_size__`` (a test may
declare the size it ends on while starting on another). A test that switches pools goes last
among its first size when its last size is the next size in the run (2 then 3: the 3s continue
on its pool); otherwise first among its last size (2 then 4 after the 3s: one start of a 2-pool
instead of a 4-pool started between the 2s and the 3s and started again after them). Run in
this order the pre-existing files start 5 pools (2, 3, 2, 4, 8) instead of 7.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module, preload_in_workers

_FRESH = load_test_module(Path(__file__).with_name("_fresh_imports.py"), "hp_trainer_tests_fresh")
# Imported once by the workers' fork server (see _fresh_imports.WORKER_PRELOAD, which
# test_multinode checks for device queries); then the shipped corpus is tokenized there once
preload_in_workers(*_FRESH.WORKER_PRELOAD, files=[Path(__file__).with_name("_warm_tokens.py")])
#: the tests that read the fresh interpreter's answer (_fresh_imports.report)
_ASK_FRESH = (
    "test_hp_trainer_package.py::test_import_does_not_import_dynamo",
    "test_multinode.py::test_forkserver_preload_queries_no_device",
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fresh interpreter of _fresh_imports in the background if a test will ask."""
    if any(item.nodeid.endswith(_ASK_FRESH) for item in session.items):
        _FRESH.start()


def _evaluable(node: ast.expr) -> bool:
    allowed = (ast.Name, ast.Constant, ast.Subscript, ast.Attribute, ast.Tuple, ast.expr_context)
    return all(isinstance(n, allowed) for n in ast.walk(node))


def _evaluate(node: ast.expr, env: dict[str, Any]) -> Any:
    if not _evaluable(node):
        raise ValueError("not a plain lookup")
    code = compile(ast.Expression(body=node), "<world-size>", "eval")
    return eval(code, {"__builtins__": {}}, env)  # names, constants and subscripts only


@functools.cache
def _world_size_calls(fn: Any) -> tuple[ast.FunctionDef, list[ast.expr]] | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef):
        return None
    calls = [
        node
        for node in ast.walk(func)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "run_distributed"
    ]
    calls.sort(key=lambda c: (c.lineno, c.col_offset))
    sizes: list[ast.expr] = []
    for call in calls:
        keyword = [k.value for k in call.keywords if k.arg == "world_size"]
        if keyword or len(call.args) > 1:
            sizes.append(keyword[0] if keyword else call.args[1])
    return func, sizes


def _world_sizes(item: pytest.Item) -> tuple[int, int] | None:
    fn = getattr(item, "function", None)
    declared = getattr(fn, "__hp_world_size__", None)
    if declared:
        return int(declared), int(declared)
    return _call_sizes(item)


def _call_sizes(item: pytest.Item) -> tuple[int, int] | None:
    """(first, last) world size of the test's own ``run_distributed`` calls, if readable."""
    fn = getattr(item, "function", None)
    found = _world_size_calls(fn) if fn is not None else None
    if not found:
        return None
    func, sizes = found
    callspec = getattr(item, "callspec", None)
    module = getattr(item, "module", None)
    env: dict[str, Any] = {
        **(vars(module) if module else {}),
        **(callspec.params if callspec else {}),
    }
    for stmt in func.body:  # simple bindings: ``ws, par, dp = _CASES[case]``
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        target = stmt.targets[0]
        try:
            value = _evaluate(stmt.value, env)
        except Exception:  # anything but a plain lookup (or a failing one) is skipped
            continue
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif (
            isinstance(target, ast.Tuple)
            and all(isinstance(e, ast.Name) for e in target.elts)
            and isinstance(value, tuple | list)
            and len(value) == len(target.elts)
        ):
            names = [e.id for e in target.elts if isinstance(e, ast.Name)]
            env.update(zip(names, value, strict=True))
    resolved = []
    for size in sizes:
        try:
            value = _evaluate(size, env)
        except Exception:
            return None
        if not isinstance(value, int):
            return None
        resolved.append(value)
    return (resolved[0], resolved[-1]) if resolved else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Sort by world size so that each pool starts once (see the module docstring)."""

    def sizes(item: pytest.Item) -> tuple[int, int]:
        found = _call_sizes(item) or _world_sizes(item)
        if found is None:
            ws = int(getattr(getattr(item, "function", None), "__hp_world_size__", 0))
            return ws, ws
        return found

    found = [sizes(item) for item in items]
    firsts = sorted({first for first, _ in found})

    def key(first: int, last: int) -> tuple[int, int, int]:
        if first == last:
            return first, 0, last
        following = [ws for ws in firsts if ws > first]
        if following and following[0] == last:
            return first, 1, last  # last among its first size; the next size continues
        return last, -1, first  # first among its last size

    order = sorted(range(len(items)), key=lambda i: key(*found[i]))  # stable
    items[:] = [items[i] for i in order]
