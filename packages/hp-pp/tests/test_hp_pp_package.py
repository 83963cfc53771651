"""Package-level checks for hp-pp."""

import importlib.metadata

import hp_pp


def test_version_matches_metadata() -> None:
    assert hp_pp.__version__ == importlib.metadata.version("hp-pp")


def test_all_names_resolve() -> None:
    for name in hp_pp.__all__:
        assert hasattr(hp_pp, name), name
