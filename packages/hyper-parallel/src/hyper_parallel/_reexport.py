"""Gather the public names of every component package."""

from __future__ import annotations

import importlib
from typing import Any

#: Component import names, in dependency order.
COMPONENTS: tuple[str, ...] = (
    "hp_dtensor",
    "hp_kernels",
    "hp_fsdp",
    "hp_tp",
    "hp_pp",
    "hp_cp_ep",
    "hp_dcp",
    "hp_trainer",
)


def collect_public_api() -> dict[str, Any]:
    """Return ``{name: object}`` for every name in each component's ``__all__``.

    Raises:
        ImportError: when two components export different objects under one name, which would
            make ``hyper_parallel.<name>`` ambiguous.
    """
    api: dict[str, Any] = {}
    for component in COMPONENTS:
        module = importlib.import_module(component)
        for name in module.__all__:
            if name == "__version__":
                continue
            obj = getattr(module, name)
            if name in api and api[name] is not obj:
                raise ImportError(
                    f"hyper_parallel: {component}.{name} clashes with another component's {name}"
                )
            api[name] = obj
    return api
