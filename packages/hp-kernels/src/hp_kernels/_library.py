"""Private constants shared by the op modules: the op namespace and dispatch names.

hp-kernels depends only on torch, so it does not import ``hp_dtensor.device``. The only
dispatch name it needs is PyTorch's generic out-of-tree backend slot, ``"privateuseone"``,
which is where Ascend's ``torch_npu`` (and any other PrivateUse1 backend) registers itself.
Registering under this generic name is import-safe on every build of torch: the backend-specific
name only exists once the plugin has renamed the slot.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef

__all__: list[str] = []

#: ``torch.library`` namespace of every op in this package (``torch.ops.hp_kernels.*``).
NAMESPACE = "hp_kernels"

#: PyTorch's device type for the PrivateUse1 dispatch key (out-of-tree accelerators).
PRIVATEUSE1_DEVICE_TYPE = "privateuseone"


def qualname(name: str) -> str:
    """Return the fully qualified op name ``hp_kernels::<name>``."""
    return f"{NAMESPACE}::{name}"


def module_available(name: str) -> bool:
    """Return whether ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: The pure-torch reference kernel of every op, by op name (filled at import by ``define_op``).
REFERENCE_KERNELS: dict[str, Callable[..., Any]] = {}


def define_op(
    name: str, *, mutates_args: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], CustomOpDef]:
    """Define ``hp_kernels::<name>`` with the decorated function as its reference kernel."""

    def wrap(fn: Callable[..., Any]) -> CustomOpDef:
        REFERENCE_KERNELS[name] = fn
        return torch.library.custom_op(qualname(name), mutates_args=mutates_args)(fn)

    return wrap
