"""Where a "See Also" reference to PyTorch or TorchTitan points, computed without network.

Shared by the ``pt``/``titan`` roles (``hp_see_also``) and by scripts/tests/test_see_also_links.py,
so the build and the test agree on which targets exist. No Sphinx import here.

- PyTorch: a dotted name must import from the installed torch; its link is the object's source at
  the installed version's tag on GitHub (``inspect``), or the docs search page for objects written
  in C (no Python source). Online builds prefer the intersphinx inventory (see ``hp_see_also``).
- TorchTitan: it is not installed, so ``docs/_ext/torchtitan_sources.toml`` lists every object
  and file the docstrings name, each file pinned to a commit whose copy was checked to hold it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

PYTORCH_REPO = "https://github.com/pytorch/pytorch"
TORCHTITAN_REPO = "https://github.com/pytorch/torchtitan"
TORCHTITAN_SOURCES = Path(__file__).resolve().parent / "torchtitan_sources.toml"


class UnknownTargetError(LookupError):
    """A role target that names nothing (a typo, or an object removed upstream)."""


def split_title(text: str) -> tuple[str, str]:
    """``"title <target>"`` -> (title, target); a bare ``"target"`` is its own title."""
    match = re.fullmatch(r"(?s)(.*?)\s*<([^<>]+)>", text.strip())
    if match and match.group(1):
        return match.group(1), match.group(2).strip()
    return text.strip(), text.strip()


def resolve_torch_object(name: str) -> Any:
    """Import ``name`` (``torch.a.b.C.meth``) from the installed torch (UnknownTargetError)."""
    parts = name.split(".")
    if parts[0] != "torch":
        raise UnknownTargetError(f"{name!r} is not a dotted name under 'torch'")
    obj: Any = importlib.import_module("torch")
    for depth, attr in enumerate(parts[1:], start=2):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        module = ".".join(parts[:depth])
        if not inspect.ismodule(obj):
            raise UnknownTargetError(
                f"{name!r} does not exist in the installed torch (no {module!r})"
            )
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                raise UnknownTargetError(
                    f"{name!r} does not exist in the installed torch"
                ) from None
            return _UnimportableModuleMember(module, parts[depth:], exc)
    return obj


@dataclass(frozen=True)
class _UnimportableModuleMember:
    """A member of a torch module that exists but needs a missing package to import
    (``torch.testing._internal`` needs ``expecttest``): found in its source instead."""

    module: str
    attrs: list[str]
    error: ModuleNotFoundError

    def source(self) -> tuple[Path, int]:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise UnknownTargetError(f"{self.module!r} does not import: {self.error}")
        origin = Path(spec.origin)
        if not self.attrs:
            return origin, 0
        tree = ast.parse(origin.read_text(encoding="utf-8"))
        for node in tree.body:
            names = [getattr(node, "name", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [getattr(t, "id", None) for t in targets]
            if self.attrs[0] in names:
                return origin, node.lineno
        raise UnknownTargetError(f"{self.module!r} has no top-level {self.attrs[0]!r}")


class TorchSourceLinks:
    """Links into PyTorch's source at the tag of the installed version."""

    def __init__(self) -> None:
        import torch

        version = torch.__version__.split("+")[0]
        self.version = version
        self.docs = "https://docs.pytorch.org/docs/" + ".".join(version.split(".")[:2])
        self._root = Path(torch.__file__).resolve().parent.parent
        self._blob = f"{PYTORCH_REPO}/blob/v{version}"
        self._sources: dict[str, list[str]] = {}  # file -> its lines, read once

    def page(self, page: str) -> str:
        """A page of PyTorch's documentation (``distributed.pipelining.html``)."""
        return f"{self.docs}/{page}"

    def url(self, name: str) -> str:
        """Link for a dotted torch name; raises UnknownTargetError when it does not import."""
        obj = resolve_torch_object(name)
        if isinstance(obj, _UnimportableModuleMember):
            file, line = obj.source()
            located: tuple[str, int] | None = (self._relative(str(file)) or "", line)
        elif inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
            located = self._locate(obj)
        else:
            located = self._locate(obj) or self._locate_attribute(name)
        if located is None:
            # Written in C (torch.empty, torch.Event, operators): no Python source to point at.
            return f"{self.docs}/search.html?q={name}"
        path, line = located
        return f"{self._blob}/{path}#L{line}" if line > 0 else f"{self._blob}/{path}"

    def _relative(self, file: str | None) -> str | None:
        if file is None:
            return None
        try:
            return Path(file).resolve().relative_to(self._root).as_posix()
        except ValueError:
            return None

    def _lines(self, path: str) -> list[str]:
        if path not in self._sources:
            self._sources[path] = (self._root / path).read_text(encoding="utf-8").splitlines()
        return self._sources[path]

    def _locate_class(self, cls: type) -> tuple[str, int] | None:
        # Its module's file first; public classes often say they live in the package that
        # re-exports them (``__module__`` rewritten for the docs): then the files of its methods,
        # then (a dataclass: no method has a file) every file of that package.
        module_file = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
        files = [self._relative(module_file)]
        for member in vars(cls).values():
            code = getattr(inspect.unwrap(member), "__code__", None) if callable(member) else None
            files.append(self._relative(code.co_filename) if code is not None else None)
        if module_file.endswith("__init__.py") and hasattr(cls, "__dataclass_fields__"):
            files += [
                self._relative(str(p)) for p in sorted(Path(module_file).parent.rglob("*.py"))
            ]
        pattern = re.compile(rf"\s*class\s+{re.escape(cls.__name__)}\b")
        for path in dict.fromkeys(f for f in files if f):
            # Only a file whose (already imported) module holds this very class: another
            # ``class Stream`` elsewhere in the package is not it.
            module = sys.modules.get(
                path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            )
            if getattr(module, cls.__name__, None) is not cls:
                continue
            for number, line in enumerate(self._lines(path), start=1):
                if pattern.match(line):
                    return path, number
        return None

    def _locate(self, obj: Any) -> tuple[str, int] | None:
        if isinstance(obj, property) and obj.fget is not None:
            obj = obj.fget
        obj = inspect.unwrap(obj) if callable(obj) else obj
        if inspect.isclass(obj):
            return self._locate_class(obj)
        code = getattr(obj, "__code__", None)  # a Python function or method
        file = code.co_filename if code is not None else getattr(obj, "__file__", None)
        path = self._relative(file) if inspect.ismodule(obj) or code is not None else None
        if path is None:
            return None
        return path, code.co_firstlineno if code is not None else 0

    def _locate_attribute(self, name: str) -> tuple[str, int] | None:
        # A data attribute (a config flag, a class-level table): its assignment in the source of
        # the module or class that holds it.
        owner_name, _, attr = name.rpartition(".")
        located = self._locate(resolve_torch_object(owner_name))
        if located is None:
            return None
        path, start = located
        lines = self._lines(path)
        pattern = re.compile(rf"\s*{re.escape(attr)}\s*[:=]")
        for number in range(max(start, 1), len(lines) + 1):
            if pattern.match(lines[number - 1]):
                return path, number
        return path, start


@dataclass(frozen=True)
class TorchTitanSources:
    """The checked-in map: object name -> file, file -> pinned commit of pytorch/torchtitan.

    An object may name its own commit (``"path@<sha>"``) when the file's pinned copy lacks it
    and an older or newer copy of the same file defines it.
    """

    files: dict[str, str]
    objects: dict[str, str]

    @classmethod
    def load(cls, path: Path = TORCHTITAN_SOURCES) -> TorchTitanSources:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        sources = cls(files=dict(data["files"]), objects=dict(data["objects"]))
        paths = {value.partition("@")[0] for value in sources.objects.values()}
        unpinned = sorted(paths - set(sources.files))
        if unpinned:
            raise ValueError(f"{path}: objects in files without a pinned commit: {unpinned}")
        return sources

    def url(self, target: str) -> str:
        """Link for a TorchTitan object (``torchtitan.x.Y``) or file (``torchtitan/x.py``)."""
        path, _, commit = (target if "/" in target else self.objects.get(target, "")).partition("@")
        if path not in self.files:
            raise UnknownTargetError(
                f"TorchTitan target {target!r} is not in {TORCHTITAN_SOURCES.name}: add it "
                "with the file that defines it at a commit you checked"
            )
        return f"{TORCHTITAN_REPO}/blob/{commit or self.files[path]}/{path}"
