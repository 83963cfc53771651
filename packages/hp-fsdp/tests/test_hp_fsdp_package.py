"""Package-level checks for hp-fsdp."""

import importlib.metadata

import hp_fsdp


def test_version_matches_metadata() -> None:
    assert hp_fsdp.__version__ == importlib.metadata.version("hp-fsdp")


def test_all_names_resolve() -> None:
    for name in hp_fsdp.__all__:
        assert hasattr(hp_fsdp, name), name
