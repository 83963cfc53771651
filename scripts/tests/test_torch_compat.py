"""PyTorch internals are reached from one place per package: its ``_torch_compat.py``.

(a) Every compat module imports (each private name it resolves is checked at import, with an
error naming the name and the torch version) and lists its names in ``PRIVATE_NAMES``; each
listed name resolves on the installed torch.
(b) No other source file spells a private PyTorch name: a name with a ``_``-prefixed part reached
through an ``import``/``from torch... import``, an attribute chain on something imported from
torch (``torch._C._x``, ``DTensor._op_dispatcher``), or ``getattr(torch..., "_x")``. Attribute
access on *instances* (``mesh._flatten()``) is invisible to this static check.

A PyTorch upgrade that drops a name therefore fails in (a), in one obvious place.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workspace import load_packages

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = load_packages()
COMPAT_FILE = "_torch_compat.py"

#: Private names still used outside a compat module: {file: (names, reason)}. Keep it short.
ALLOWED: dict[str, tuple[frozenset[str], str]] = {}


def _allowed(rel: str, name: str) -> bool:
    return name in ALLOWED.get(rel, (frozenset(), ""))[0]


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def private_torch_names(source: str) -> set[str]:
    """The private PyTorch names (fully qualified) a module's code uses."""
    tree = ast.parse(source)
    from_torch: dict[str, str] = {}  # local name -> the torch object it is bound to
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if _is_private(alias.name):
                        found.add(alias.name)
                    local = alias.asname or "torch"
                    from_torch[local] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_private(full):
                    found.add(full)
                from_torch[alias.asname or alias.name] = full
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
            root, _, rest = (chain or "").partition(".")
            # Trim the chain to its last private part (``torch._C._x.y`` -> ``torch._C._x``).
            if root in from_torch and _is_private(rest):
                parts = rest.split(".")
                last = max(i for i, p in enumerate(parts) if _is_private(p))
                found.add(".".join([from_torch[root], *parts[: last + 1]]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
        ):
            owner = _dotted(node.args[0])
            root, _, rest = (owner or "").partition(".")
            if root in from_torch:
                found.add(".".join(filter(None, [from_torch[root], rest, node.args[1].value])))
    return found


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (pkg.directory / "src").rglob("*.py"))


def _compat_modules() -> list[str]:
    return [
        f"{pkg.import_name}._torch_compat"
        for pkg in PACKAGES
        if (pkg.directory / "src" / pkg.import_name / COMPAT_FILE).exists()
    ]


@pytest.mark.parametrize("module_name", _compat_modules())
def test_compat_module_resolves_its_names(module_name: str) -> None:
    from hp_dtensor._torch_compat import require

    module = importlib.import_module(module_name)
    names = module.PRIVATE_NAMES
    assert names, f"{module_name} lists no PRIVATE_NAMES"
    assert len(set(names)) == len(names), f"{module_name} lists a name twice"
    for name in names:
        assert _is_private(name), f"{module_name} lists public name {name}"
        require(module_name, name)  # raises ImportError naming the name and torch version


def test_no_private_torch_names_outside_compat_modules() -> None:
    listed = {n for m in _compat_modules() for n in importlib.import_module(m).PRIVATE_NAMES}
    unexpected = []
    for path in _sources():
        if path.name == COMPAT_FILE:
            continue
        rel = str(path.relative_to(ROOT))
        for name in sorted(private_torch_names(path.read_text())):
            if not _allowed(rel, name):
                hint = " (in a compat module: import it from there)" if name in listed else ""
                unexpected.append(f"{rel}: {name}{hint}")
    assert not unexpected, "private PyTorch names outside _torch_compat.py:\n" + "\n".join(
        unexpected
    )


def test_allow_list_has_no_stale_entries() -> None:
    used = {
        (str(p.relative_to(ROOT)), n)
        for p in _sources()
        if p.name != COMPAT_FILE
        for n in private_torch_names(p.read_text())
    }
    allowed = {(rel, name) for rel, (names, _) in ALLOWED.items() for name in names}
    assert not allowed - used, sorted(allowed - used)


def test_scanner_finds_each_kind_of_use() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.tensor import DTensor\n"
        "from torch.utils._pytree import tree_map\n"
        "torch._C._set_grad_enabled(False)\n"
        "dist.distributed_c10d._world.pg_map\n"
        "DTensor._op_dispatcher.sharding_propagator\n"
        "getattr(torch.library, '_impls', None)\n"
        "torch.nn.Linear(2, 2)\n"
    )
    assert private_torch_names(source) == {
        "torch.utils._pytree.tree_map",
        "torch._C._set_grad_enabled",
        "torch.distributed.distributed_c10d._world",
        "torch.distributed.tensor.DTensor._op_dispatcher",
        "torch.library._impls",
    }


def test_missing_name_error_names_it_and_the_torch_version() -> None:
    import torch

    from hp_dtensor._torch_compat import require

    with pytest.raises(ImportError) as info:
        require("hp-example", "torch.distributed._no_such_module._x")
    message = str(info.value)
    assert "torch.distributed._no_such_module._x" in message
    assert torch.__version__ in message
    assert "hp-example" in message
    with pytest.raises(ImportError, match=r"torch\._C\._no_such_function"):
        require("hp-example", "torch._C._no_such_function")
