"""Package-level checks for hp-cp-ep."""

import importlib.metadata

import hp_cp_ep


def test_version_matches_metadata() -> None:
    assert hp_cp_ep.__version__ == importlib.metadata.version("hp-cp-ep")


def test_all_names_resolve() -> None:
    for name in hp_cp_ep.__all__:
        assert hasattr(hp_cp_ep, name), name
