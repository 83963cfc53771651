"""Generate the interface-parity matrix from the installed code.

The map lives in ``docs/parity/*.toml``: one file per area, one ``[[interface]]`` table per row of
the seed comparison documents. Each row names the hyper-parallel object that provides it (``hp``,
a dotted path ``package.Name[.attribute]``), the PyTorch counterpart (``torch``, imported and
compared when given), the TorchTitan name (``titan``, recorded only: TorchTitan is not installed),
optionally one parameter (``param``) when the row is about a single argument, and ``reason``: why a
signature differs from PyTorch's, or why nothing is provided (``not_provided``, one of
:data:`NOT_PROVIDED_KINDS`).

The status of a row is computed, never written by hand:

- ``same``: hp's signature equals PyTorch's (names, kinds, defaults);
- ``extension``: equal, plus keyword-only parameters with defaults;
- ``differs``: anything else; the row must say why (``reason``);
- ``opaque``: PyTorch's counterpart is a C++ type without a Python signature;
- ``hp-only``: no PyTorch counterpart to compare with;
- ``not-provided``: no hp object, with the kind and the reason.

``python scripts/parity.py`` writes ``docs/parity.rst``; ``--check`` exits 1 when the map has a
problem (missing object, undocumented or stale difference, name absent from ``__all__``) or the
committed page is out of date. ``scripts/tests/test_parity_matrix.py`` runs the same check in CI.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
MAP_DIR = ROOT / "docs" / "parity"
PAGE = ROOT / "docs" / "parity.rst"

NOT_PROVIDED_KINDS = ("pytorch-own", "later", "next", "out-of-scope", "internal")
STATUS_MARK = {
    "same": "✅ same",
    "extension": "🔶 keyword-only extension",
    "differs": "⚠️ differs",
    "opaque": "🔷 same name (PyTorch's signature not introspectable)",
    "hp-only": "🟦 hyper-parallel only",
    "not-provided": "❌ not provided",
}
ROW_KEYS = {"name", "hp", "torch", "titan", "param", "reason", "not_provided"}


@dataclass(frozen=True)
class Row:
    """One interface of the map and its computed status."""

    area: str
    name: str
    hp: str | None
    torch: str | None
    titan: str | None
    param: str | None
    reason: str | None
    not_provided: str | None
    status: str
    detail: str


def resolve(path: str) -> Any:
    """Import ``a.b.C.attr``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import any prefix of {path!r}")


def _parameters(obj: Any) -> list[inspect.Parameter]:
    if inspect.isclass(obj) and obj.__init__ is object.__init__:
        return []  # no constructor of its own: object's (*args, **kwargs) is not an interface
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        sig = inspect.signature(obj)  # ValueError for a C++ type: the caller handles it
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


def _same_default(a: Any, b: Any) -> bool:
    if a is b:
        return True
    # Policy objects (MixedPrecisionPolicy(), OffloadPolicy()) are hp's own classes mirroring
    # torch's: the same class name stands for the same default.
    if type(a).__name__ == type(b).__name__ and type(a).__module__ != type(b).__module__:
        return True
    try:
        return bool(a == b)
    except Exception:  # a default whose == raises is simply not equal
        return False


def _describe(p: inspect.Parameter) -> str:
    return str(p.replace(annotation=inspect.Parameter.empty))


def compare(hp_obj: Any, torch_obj: Any) -> tuple[str, str]:
    """Classify hp's signature against torch's: (status, what differs)."""
    if hp_obj is torch_obj:
        return "same", "re-exported from PyTorch"
    try:
        ours = _parameters(hp_obj)
        theirs = _parameters(torch_obj)
    except (TypeError, ValueError):
        return "opaque", f"{torch_obj!r} is implemented in C++: no Python signature to compare"
    by_name = {p.name: p for p in ours}
    problems: list[str] = []
    for p in theirs:
        q = by_name.get(p.name)
        if q is None:
            problems.append(f"missing {_describe(p)}")
        elif q.kind != p.kind:
            problems.append(f"{p.name}: kind {q.kind.description} (torch {p.kind.description})")
        elif not _same_default(q.default, p.default):
            problems.append(f"{p.name}: default {q.default!r} (torch {p.default!r})")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ours_pos = [p.name for p in ours if p.kind in positional]
    theirs_pos = [p.name for p in theirs if p.kind in positional]
    if not problems and ours_pos != theirs_pos:
        problems.append(f"positional order {ours_pos} (torch {theirs_pos})")
    torch_names = {p.name for p in theirs}
    extra = [p for p in ours if p.name not in torch_names]
    bad_extra = [
        p
        for p in extra
        if p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
        or (p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty)
    ]
    problems += [f"extra {_describe(p)}" for p in bad_extra]
    if problems:
        return "differs", "; ".join(problems)
    if extra:
        return "extension", "adds " + ", ".join(_describe(p) for p in extra)
    return "same", ""


def _check_public(hp_path: str) -> str | None:
    package, _, rest = hp_path.partition(".")
    name = rest.split(".")[0]
    module = importlib.import_module(package)
    if name not in getattr(module, "__all__", ()):
        return f"{name!r} is not in {package}.__all__"
    meta = importlib.import_module("hyper_parallel")
    if name not in meta.__all__:
        return f"{name!r} is not in hyper_parallel.__all__"
    return None


def _param_names(obj: Any) -> set[str]:
    return {p.name for p in _parameters(obj)}


def _is_extension(obj: Any, name: str) -> bool:
    """Whether ``name`` is a keyword-only parameter of ``obj`` with a default."""
    for p in _parameters(obj):
        if p.name == name:
            return p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty
    return False


def classify(area: str, entry: dict[str, Any], errors: list[str]) -> Row:
    """Compute the status of one map entry; append every problem found to ``errors``."""
    where = f"{area}: {entry.get('name', '?')}"
    unknown = set(entry) - ROW_KEYS
    if unknown or "name" not in entry:
        errors.append(f"{where}: unknown keys {sorted(unknown)} or no name")
    hp, torch_path = entry.get("hp"), entry.get("torch")
    param, reason, np_kind = entry.get("param"), entry.get("reason"), entry.get("not_provided")
    status, detail = "hp-only", ""
    if hp is None:
        status = "not-provided"
        if np_kind not in NOT_PROVIDED_KINDS or not reason:
            errors.append(f"{where}: no hp object: needs not_provided in {NOT_PROVIDED_KINDS}")
    else:
        if np_kind is not None:
            errors.append(f"{where}: has an hp object and not_provided")
        try:
            hp_obj = resolve(hp)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{where}: hp object {hp} missing ({exc})")
            hp_obj = None
        public = _check_public(hp)
        if public:
            errors.append(f"{where}: {public}")
        torch_obj = None
        if torch_path is not None:
            try:
                torch_obj = resolve(torch_path)
            except (ImportError, AttributeError) as exc:
                errors.append(f"{where}: torch counterpart {torch_path} missing ({exc})")
        if hp_obj is not None and param is not None:
            if param not in _param_names(hp_obj):
                errors.append(f"{where}: {hp} has no parameter {param!r}")
            if torch_obj is not None and param not in _param_names(torch_obj):
                status, detail = "differs", f"torch has no parameter {param!r}"
                if _is_extension(hp_obj, param):
                    status, detail = "extension", f"keyword-only, not in {torch_path}"
            elif torch_obj is not None:
                status = "same"
        elif hp_obj is not None and torch_obj is not None and callable(hp_obj):
            status, detail = compare(hp_obj, torch_obj)
        if status == "differs" and not reason:
            errors.append(f"{where}: signature differs from {torch_path} ({detail}): add a reason")
        if status != "differs" and reason and hp_obj is not None and torch_obj is not None:
            errors.append(f"{where}: reason given but the signature is {status}: remove it")
    return Row(
        area, entry.get("name", "?"), hp, torch_path, entry.get("titan"), param, reason, np_kind,
        status, detail,
    )  # fmt: skip


def load_rows(errors: list[str]) -> list[Row]:
    """Every row of every map file, classified."""
    rows: list[Row] = []
    for path in sorted(MAP_DIR.glob("*.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        for entry in data.get("interface", []):
            rows.append(classify(path.stem, entry, errors))
    if not rows:
        errors.append(f"no interfaces found under {MAP_DIR}")
    return rows


def _lit(text: str | None) -> str:
    return f"``{text}``" if text else "—"


def _cell(text: str) -> str:
    """Free text as rst: one line, inline markup characters escaped."""
    text = " ".join(text.split())
    for char in "\\*`_|":
        text = text.replace(char, "\\" + char)
    return text


def render(rows: list[Row]) -> str:
    """The rst page: a summary of counts, then one table per area."""
    titles = {}
    for path in sorted(MAP_DIR.glob("*.toml")):
        titles[path.stem] = tomllib.loads(path.read_text(encoding="utf-8")).get("title", path.stem)
    counts = Counter(r.status for r in rows)
    out = [
        ".. This page is generated by scripts/parity.py from docs/parity/*.toml: do not edit.",
        "",
        "Framework comparison (interface parity)",
        "=======================================",
        "",
        "Every interface of the PyTorch / TorchTitan / HyperParallel comparison tables, mapped to",
        "the hyper-parallel object that provides it. Statuses are computed from the installed",
        "code:",
        "hp's signature is compared with the installed PyTorch counterpart (parameter names, kinds",
        "and defaults). TorchTitan is not installed: its names are recorded, not compared.",
        "",
    ]
    for status, mark in STATUS_MARK.items():
        out.append(f"- {mark}: {counts.get(status, 0)}")
    out.append("")
    for area in sorted({r.area for r in rows}):
        title = titles.get(area, area)
        out += [title, "-" * len(title), "", ".. list-table::", "   :header-rows: 1", ""]
        out += [
            "   * - Interface",
            "     - hyper-parallel",
            "     - PyTorch",
            "     - TorchTitan",
            "     - Status",
            "     - Notes",
        ]
        for r in (r for r in rows if r.area == area):
            name = _cell(r.name) + (f" · ``{r.param}``" if r.param else "")
            note = r.reason or r.detail or ""
            if r.not_provided:
                note = f"{r.not_provided}: {note}"
            elif r.status == "extension":
                note = r.detail
            out += [
                f"   * - {name}",
                f"     - {_lit(r.hp)}",
                f"     - {_lit(r.torch)}",
                f"     - {_lit(r.titan)}",
                f"     - {STATUS_MARK[r.status]}",
                f"     - {_cell(note) if note else '—'}",
            ]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the map or page is stale")
    args = parser.parse_args(argv)
    errors: list[str] = []
    rows = load_rows(errors)
    page = render(rows)
    if args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page:
            errors.append(f"{PAGE} is out of date: run python scripts/parity.py")
    else:
        PAGE.write_text(page, encoding="utf-8")
    counts = Counter(r.status for r in rows)
    print(", ".join(f"{s}: {counts.get(s, 0)}" for s in STATUS_MARK))
    for r in rows:
        if r.status == "differs":
            print(f"  differs  {r.area}: {r.name}: {r.reason} [{r.detail}]")
    for e in errors:
        print("ERROR", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
