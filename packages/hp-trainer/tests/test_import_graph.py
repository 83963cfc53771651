"""hp-trainer's import graph: no circle, and no private name imported across modules.

The graph is read from the sources (``ast``), with module-level and function-level imports alike
(a function-level import is a circle that bites at call time instead of import time). An edge
``a -> b`` means "running ``a`` may run ``b``": importing ``x.y.z`` also runs the ``__init__`` of
``x.y`` unless the importer already lives inside it. Two kinds of import are left out, on purpose:
``if TYPE_CHECKING:`` blocks (never run) and the root ``hp_trainer/__init__`` as an implicit
parent (it is the facade that imports everything, and it always runs first). The built-in
model registry imports the families by name (``importlib``), which the graph does not see: that
is the point, the registry depends on no model.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import hp_trainer

ROOT = "hp_trainer"
SRC = Path(hp_trainer.__file__).resolve().parent

#: Private names imported across modules on purpose: none.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()
#: The one module that reaches PyTorch's private names (DESIGN.md: one compat module per package).
COMPAT_MODULE = "_torch_compat"


def _module_of(path: Path, src: Path, root: str) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run (``if TYPE_CHECKING:`` bodies skipped)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_graph(
    sources: Mapping[str, tuple[str, bool]], root: str = ROOT
) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph of a package and its private-name imports.

    Args:
        sources: Module name -> (source text, is a package ``__init__``).
        root: The package's name.

    Returns:
        ``(edges, private)``: module -> modules it may run; ``"importer: from m import _x"``
        lines for private names imported from another module.
    """
    modules = set(sources)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []

    def add(importer: str, target: str) -> None:
        own_packages = {
            ".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)
        }
        parts = target.split(".")
        for i in range(2, len(parts) + 1):  # the root facade is never an implicit parent
            mod = ".".join(parts[:i])
            if mod in modules and mod != importer and (mod == target or mod not in own_packages):
                edges[importer].add(mod)
        if target == root and importer != root:
            edges[importer].add(root)

    for importer, (text, is_package) in sources.items():
        for node in _imports(ast.parse(text)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        add(importer, alias.name)
                continue
            module = _absolute(importer, is_package, node)
            for alias in node.names:
                name = alias.name
                is_private = name.startswith("_") and not name.startswith("__")
                if (
                    is_private
                    and module != importer
                    and (importer, name) not in ALLOWED_PRIVATE
                    and not importer.endswith("." + COMPAT_MODULE)
                ):
                    private.append(f"{importer}: from {module} import {name}")
            if module.split(".")[0] != root:
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                add(importer, sub if sub in modules else module)
    return edges, private


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {
        _module_of(path, SRC, ROOT): (path.read_text(), path.name == "__init__.py")
        for path in sorted(SRC.rglob("*.py"))
    }


def test_hp_trainer_has_no_import_circle() -> None:
    edges, _ = read_graph(_package_sources())
    assert len(edges) > 60  # the whole package was read
    found = circles(edges)
    assert not found, "import circles in hp-trainer:\n" + "\n".join(" -> ".join(c) for c in found)


def test_hp_trainer_imports_no_private_name_across_modules() -> None:
    _, private = read_graph(_package_sources())
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_the_checker_sees_circles_through_functions_and_package_inits() -> None:
    # a -> b at module level, b -> a inside a function: a circle
    src = {
        "pkg": ("", True),
        "pkg.a": ("from pkg.b import f\n", False),
        "pkg.b": ("def f():\n    from pkg.a import g\n", False),
        "pkg.sub": ("from pkg.sub import leaf\n", True),
        "pkg.sub.leaf": ("X = 1\n", False),
        "pkg.c": ("from pkg.sub.leaf import X\n", False),
    }
    assert circles(read_graph(src, "pkg")[0]) == [["pkg.a", "pkg.b"]]
    # the leaf imports its package's user: pkg.sub -> leaf -> c -> pkg.sub (an implicit parent)
    src["pkg.sub.leaf"] = ("from pkg.c import Y\n", False)
    assert ["pkg.c", "pkg.sub", "pkg.sub.leaf"] in circles(read_graph(src, "pkg")[0])
    # TYPE_CHECKING imports never run
    src["pkg.b"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        False,
    )
    src["pkg.sub.leaf"] = ("X = 1\n", False)
    assert circles(read_graph(src, "pkg")[0]) == []


def test_the_checker_sees_private_names_and_relative_imports() -> None:
    src = {
        "pkg": ("", True),
        "pkg.a": ("from .b import _hidden, visible\nfrom pkg.b import __doc__\n", False),
        "pkg.b": ("def f():\n    from . import a\n", False),
    }
    edges, private = read_graph(src, "pkg")
    assert private == ["pkg.a: from pkg.b import _hidden"]
    assert circles(edges) == [["pkg.a", "pkg.b"]]
