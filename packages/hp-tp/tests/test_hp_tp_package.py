"""Package-level checks for hp-tp."""

import importlib.metadata

import hp_tp


def test_version_matches_metadata() -> None:
    assert hp_tp.__version__ == importlib.metadata.version("hp-tp")


def test_all_names_resolve() -> None:
    for name in hp_tp.__all__:
        assert hasattr(hp_tp, name), name
