"""The interface-parity map is true of the installed code, and its docs page is up to date."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "hp_parity_script", ROOT / "scripts" / "parity.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


parity = _load_generator()


@pytest.fixture(scope="module")
def rows() -> list:
    errors: list[str] = []
    loaded = parity.load_rows(errors)
    assert not errors, "\n".join(errors)
    return loaded


def test_map_is_true_and_page_up_to_date(rows: list) -> None:
    page = (ROOT / "docs" / "parity.rst").read_text(encoding="utf-8")
    assert page == parity.render(rows), "docs/parity.rst is stale: run python scripts/parity.py"


def test_every_seed_area_is_covered(rows: list) -> None:
    names = {r.name for r in rows}
    # One anchor per seed table section: pipeline, CP, EP, trainer rows included.
    for anchor in ("fully_shard", "PipelineStage", "ContextParallel", "ExpertParallel",
                   "ParallelDims", "parallelize_module", "save", "DTensor"):  # fmt: skip
        assert anchor in names
    assert len(rows) >= 150


def test_every_hp_object_resolves_and_is_public(rows: list) -> None:
    meta = importlib.import_module("hyper_parallel")
    for r in rows:
        if r.hp is None:
            assert r.not_provided in parity.NOT_PROVIDED_KINDS
            assert r.reason
            continue
        name = r.hp.split(".")[1]
        assert name in meta.__all__, r.hp
        assert parity.resolve(r.hp) is not None


def _f(a: int, b: str = "x") -> None: ...
def _f_ext(a: int, b: str = "x", *, c: int = 0) -> None: ...
def _f_default(a: int, b: str = "y") -> None: ...
def _f_order(b: str = "x", a: int = 0) -> None: ...
def _f_required_kw(a: int, b: str = "x", *, c: int) -> None: ...


@pytest.mark.parametrize(
    ("ours", "status"),
    [
        (_f, "same"),
        (_f_ext, "extension"),
        (_f_default, "differs"),
        (_f_order, "differs"),
        (_f_required_kw, "differs"),
    ],
)
def test_compare_classifies(ours: object, status: str) -> None:
    assert parity.compare(ours, _f)[0] == status


def test_undocumented_difference_and_missing_object_fail(tmp_path: Path) -> None:
    errors: list[str] = []
    parity.classify("t", {"name": "x", "hp": "hp_tp.parallelize_module",
                          "torch": "torch.distributed.fsdp.fully_shard"}, errors)  # fmt: skip
    assert any("add a reason" in e for e in errors)
    errors.clear()
    parity.classify("t", {"name": "y", "hp": "hp_tp.no_such_thing"}, errors)
    assert any("missing" in e for e in errors)
    errors.clear()
    # A real object that is not in __all__ is refused too.
    parity.classify("t", {"name": "z", "hp": "hp_tp.style"}, errors)
    assert any("__all__" in e for e in errors)
    errors.clear()
    parity.classify("t", {"name": "w", "not_provided": "someday", "reason": "r"}, errors)
    assert errors
