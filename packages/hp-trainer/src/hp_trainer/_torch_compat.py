"""Every private PyTorch name hp-trainer uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version (the checker is hp-dtensor's).
``scripts/tests/test_torch_compat.py`` lists these names. ``flatten_mesh``
(``DeviceMesh._flatten``) is hp-dtensor's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from hp_dtensor._torch_compat import flatten_mesh, missing_torch_name, require

try:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as ptd_checkpoint_wrapper,
    )
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_map, tree_map_only
except ImportError as _exc:  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name("hp-trainer", _exc.name or str(_exc)) from _exc

__all__ = [
    "PRIVATE_NAMES",
    "SAVED_PRIVATE_OPS",
    "TorchDispatchMode",
    "disable_current_modes",
    "flatten_mesh",
    "foreach_mul_",
    "functorch_config",
    "memory_snapshot",
    "ptd_checkpoint_wrapper",
    "record_memory_history",
    "register_load_state_dict_pre_hook",
    "register_state_dict_hook",
    "tree_map",
    "tree_map_only",
]

_PACKAGE = "hp-trainer"

disable_current_modes = _disable_current_modes
#: Holds ``activation_memory_budget`` (checked here), the knob of the memory-budget AC mode.
functorch_config: Any = require(_PACKAGE, "torch._functorch.config")
require(_PACKAGE, "torch._functorch.config.activation_memory_budget")
record_memory_history: Callable[..., None] = require(
    _PACKAGE, "torch.cuda.memory._record_memory_history"
)
memory_snapshot: Callable[[], Any] = require(_PACKAGE, "torch.cuda.memory._snapshot")
#: The multi-tensor in-place multiply ``torch.nn.utils.clip_grads_with_norm_`` scales with.
foreach_mul_: Callable[..., None] = require(_PACKAGE, "torch._foreach_mul_")

# The state-dict hooks that rename a wrapper's keys (private in torch): checked here, called
# through the two functions below.
require(_PACKAGE, "torch.nn.Module._register_state_dict_hook")
require(_PACKAGE, "torch.nn.Module._register_load_state_dict_pre_hook")


def register_state_dict_hook(module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
    """``module._register_state_dict_hook(hook)``: ``hook(module, state, prefix, meta)``."""
    handle: RemovableHandle = module._register_state_dict_hook(hook)  # type: ignore[no-untyped-call]
    return handle


def register_load_state_dict_pre_hook(
    module: nn.Module, hook: Callable[..., Any]
) -> RemovableHandle:
    """``module._register_load_state_dict_pre_hook(hook)``: ``hook(state, prefix, ...)``."""
    handle: RemovableHandle = module._register_load_state_dict_pre_hook(hook)  # type: ignore[no-untyped-call]
    return handle


_PRIVATE_OPS = (
    "torch.ops.aten._scaled_dot_product_efficient_attention.default",
    "torch.ops.aten._scaled_dot_product_flash_attention.default",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default",
    "torch.ops._c10d_functional.all_to_all_single.default",
)
#: Private ops whose outputs selective per-op activation checkpointing keeps.
SAVED_PRIVATE_OPS: tuple[Any, ...] = tuple(require(_PACKAGE, op) for op in _PRIVATE_OPS)

PRIVATE_NAMES = (
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._python_dispatch._disable_current_modes",
    "torch.utils._pytree.tree_map",
    "torch.utils._pytree.tree_map_only",
    "torch._functorch.config.activation_memory_budget",
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.memory._snapshot",
    "torch._foreach_mul_",
    "torch.nn.Module._register_state_dict_hook",
    "torch.nn.Module._register_load_state_dict_pre_hook",
    *_PRIVATE_OPS,
)
