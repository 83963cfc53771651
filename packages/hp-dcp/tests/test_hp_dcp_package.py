"""Package-level checks for hp-dcp."""

import importlib.metadata

import hp_dcp


def test_version_matches_metadata() -> None:
    assert hp_dcp.__version__ == importlib.metadata.version("hp-dcp")


def test_all_names_resolve() -> None:
    for name in hp_dcp.__all__:
        assert hasattr(hp_dcp, name), name
