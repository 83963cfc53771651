"""Package-level checks for hp-kernels."""

import importlib.metadata

import hp_kernels


def test_version_matches_metadata() -> None:
    assert hp_kernels.__version__ == importlib.metadata.version("hp-kernels")


def test_all_names_resolve() -> None:
    for name in hp_kernels.__all__:
        assert hasattr(hp_kernels, name), name
