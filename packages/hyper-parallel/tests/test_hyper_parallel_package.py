"""The meta-package re-exports every component's public API."""

import importlib
import importlib.metadata
import re

import hyper_parallel
from hyper_parallel._reexport import COMPONENTS


def test_version_matches_metadata() -> None:
    assert hyper_parallel.__version__ == importlib.metadata.version("hyper-parallel")


def test_every_component_name_is_reexported_as_the_same_object() -> None:
    for component in COMPONENTS:
        module = importlib.import_module(component)
        for name in module.__all__:
            if name == "__version__":
                continue
            assert getattr(hyper_parallel, name) is getattr(module, name), f"{component}.{name}"
            assert name in hyper_parallel.__all__


def test_meta_package_depends_on_every_component() -> None:
    requires = importlib.metadata.requires("hyper-parallel") or []
    names = {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in requires}  # type: ignore[union-attr]
    for component in COMPONENTS:
        assert component.replace("_", "-") in names
