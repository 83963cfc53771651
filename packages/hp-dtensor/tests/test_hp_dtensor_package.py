"""Package-level checks for hp-dtensor."""

import importlib.metadata

import hp_dtensor


def test_version_matches_metadata() -> None:
    assert hp_dtensor.__version__ == importlib.metadata.version("hp-dtensor")


def test_all_names_resolve() -> None:
    for name in hp_dtensor.__all__:
        assert hasattr(hp_dtensor, name), name
