"""Every private PyTorch name hp-kernels uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version. ``scripts/tests/test_torch_compat.py``
lists these names. hp-kernels does not depend on hp-dtensor, so the checker (the same as
``hp_dtensor._torch_compat.require``) is repeated here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = [
    "PRIVATE_NAMES",
    "AutoDispatchBelowAutograd",
    "OpOverload",
    "dispatch_has_kernel_for_dispatch_key",
    "dispatch_key_for_device",
    "foreach_copy_",
    "grouped_mm",
    "len_torch_dispatch_stack",
    "python_impls",
    "set_grad_enabled",
]

_PACKAGE = "hp-kernels"
_TESTED_TORCH_VERSIONS = "2.13.0"


def _require(qualname: str) -> Any:
    """Resolve ``module.attr[.attr...]`` or raise an ImportError naming it and this torch."""
    module, _, attr = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"{_PACKAGE} needs the PyTorch internal `{qualname}`, which the installed torch "
            f"{torch.__version__} does not provide (tested with torch {_TESTED_TORCH_VERSIONS}); "
            f"see {_PACKAGE}'s _torch_compat.py"
        ) from exc


#: ``torch.library``'s set of ``"namespace/op/DispatchKey"`` strings, one per kernel registered
#: from Python (``Library.impl``, which ``torch.library.register_kernel`` uses).
python_impls: set[str] = _require("torch.library._impls")
dispatch_has_kernel_for_dispatch_key = _require("torch._C._dispatch_has_kernel_for_dispatch_key")
dispatch_key_for_device = _require("torch._C._dispatch_key_for_device")
len_torch_dispatch_stack = _require("torch._C._len_torch_dispatch_stack")
AutoDispatchBelowAutograd = _require("torch._C._AutoDispatchBelowAutograd")
set_grad_enabled = _require("torch._C._set_grad_enabled")
foreach_copy_ = _require("torch._foreach_copy_")
#: One GEMM over variable-size row groups, one weight matrix per group (``offs``: cumulative ends).
grouped_mm = _require("torch._grouped_mm")

PRIVATE_NAMES = (
    "torch._ops.OpOverload",
    "torch.library._impls",
    "torch._C._dispatch_has_kernel_for_dispatch_key",
    "torch._C._dispatch_key_for_device",
    "torch._C._len_torch_dispatch_stack",
    "torch._C._AutoDispatchBelowAutograd",
    "torch._C._set_grad_enabled",
    "torch._foreach_copy_",
    "torch._grouped_mm",
)
