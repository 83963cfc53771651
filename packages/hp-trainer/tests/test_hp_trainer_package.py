"""Package-level checks for hp-trainer."""

import importlib.metadata
from pathlib import Path

import hp_trainer
from hp_dtensor.testing import load_test_module


def test_version_matches_metadata() -> None:
    assert hp_trainer.__version__ == importlib.metadata.version("hp-trainer")


def test_all_names_resolve() -> None:
    for name in hp_trainer.__all__:
        assert hasattr(hp_trainer, name), name


def test_import_does_not_import_dynamo() -> None:
    """Every rank and every launcher imports hp_trainer: torch._dynamo and torch._inductor
    (~1.6 of ~3.6 CPU s) wait until something compiles, and hp-pp until something pipelines.
    A fresh interpreter (``_fresh_imports``, shared with test_multinode) imports it."""
    fresh = load_test_module(
        Path(__file__).with_name("_fresh_imports.py"), "hp_trainer_tests_fresh"
    )
    report = fresh.report()
    assert report["heavy_after_import"] == [], report
