"""Package-level checks for hp-trainer."""

import importlib.metadata

import hp_trainer


def test_version_matches_metadata() -> None:
    assert hp_trainer.__version__ == importlib.metadata.version("hp-trainer")


def test_all_names_resolve() -> None:
    for name in hp_trainer.__all__:
        assert hasattr(hp_trainer, name), name
