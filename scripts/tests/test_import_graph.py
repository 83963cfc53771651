"""Every package imports only what its pyproject declares; device names live in one module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workspace import Package, load_packages

PACKAGES = load_packages()
IMPORT_TO_DIST = {p.import_name: p.dist for p in PACKAGES}
#: Third-party imports a package may make without declaring them, because it imports them lazily
#: behind a clear "install the extra" error (the extras are declared in its pyproject).
OPTIONAL_IMPORTS = {
    "torch_npu",
    "triton",
    "tokenizers",
    "yaml",
    "matplotlib",
    "tqdm",
    "tensorboard",
}
#: The only source files allowed to spell device types or dispatch keys (DESIGN.md, principle 3).
DEVICE_NAME_FILES = {
    "packages/hp-dtensor/src/hp_dtensor/device.py",
    # hp-kernels depends on torch only, so its dispatch-key names sit in one private module.
    "packages/hp-kernels/src/hp_kernels/_dispatch_keys.py",
}
DEVICE_WORDS = ("cuda", "npu")


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.dist)
def test_sibling_imports_are_declared(package: Package) -> None:
    declared = set(package.dependencies)
    own = package.import_name
    offenders = []
    for path in sorted((package.directory / "src").rglob("*.py")):
        for top in _imported_top_levels(path):
            dist = IMPORT_TO_DIST.get(top)
            if dist is not None and top != own and dist not in declared:
                offenders.append(f"{path.relative_to(package.directory)} imports {top}")
    assert not offenders, f"{package.dist} imports undeclared siblings: {offenders}"


def test_no_package_imports_a_dependent_cycle() -> None:
    graph = {
        p.dist: {d for d in p.dependencies if d in {q.dist for q in PACKAGES}} for p in PACKAGES
    }
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in visiting, f"dependency cycle: {' -> '.join([*path, node])}"
        if node in done:
            return
        visiting.add(node)
        for dep in graph[node]:
            visit(dep, [*path, node])
        visiting.discard(node)
        done.add(node)

    for node in graph:
        visit(node, [])


def test_device_names_only_in_the_device_layer() -> None:
    root = Path(__file__).resolve().parent.parent.parent
    offenders = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in DEVICE_NAME_FILES:
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value.lower()
                if value in DEVICE_WORDS or any(
                    value.startswith(f"{w}:") or value == f"privateuse1_{w}" for w in DEVICE_WORDS
                ):
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "device names outside the device layer:\n" + "\n".join(offenders)
