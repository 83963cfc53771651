"""How hp-fsdp's hooks meet ``torch.compile``: they run eagerly, as PyTorch's FSDP2 hooks do.

A compiled module whose forward is wrapped by a unit's hooks gets a graph break at each hook;
the hooks' own work (all-gathers, resharding, reductions) runs in eager mode. Modules managed by
a unit carry the attributes PyTorch sets for Dynamo (:data:`DYNAMO_MODULE_FLAGS`).

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_common._dynamo_disable`: PyTorch's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.nn as nn

from hp_dtensor._eager import run_eagerly as _run_eagerly

__all__ = ["DYNAMO_MODULE_FLAGS", "mark_managed_for_dynamo", "run_eagerly"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: Attributes PyTorch's ``fully_shard`` sets on every managed module (read by Dynamo).
DYNAMO_MODULE_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def run_eagerly(fn: _Fn) -> _Fn:
    """Hide ``fn`` from TorchDynamo (recursively): under ``torch.compile`` it runs eagerly.

    Args:
        fn: a hook or a function called from one.

    Returns:
        The wrapped function.

    See Also:
        :pt:`torch.compiler.disable`: the wrapper used, made when Dynamo traces a call (so that
        importing hp-fsdp does not import Dynamo).
    """
    return _run_eagerly(fn, reason="hp_fsdp hooks run eagerly")


def mark_managed_for_dynamo(modules: list[nn.Module]) -> None:
    """Set PyTorch's Dynamo flags on the modules a unit manages.

    Args:
        modules: the unit's managed modules (nested units excluded).
    """
    for module in modules:
        for flag in DYNAMO_MODULE_FLAGS:
            setattr(module, flag, True)
