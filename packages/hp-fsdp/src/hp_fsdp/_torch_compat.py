"""Every private PyTorch name hp-fsdp uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version (the checker is hp-dtensor's).
``scripts/tests/test_torch_compat.py`` checks these names and that no other module of hp-fsdp
spells a private PyTorch name. ``flatten_mesh``, ``local_tensor`` and ``StridedShard``
(``DeviceMesh._flatten``, ``DTensor._local_tensor``, ``_StridedShard``) are hp-dtensor's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from hp_dtensor._torch_compat import (
    StridedShard,
    flatten_mesh,
    local_tensor,
    missing_torch_name,
    require,
)

try:
    from torch.autograd.grad_mode import (
        _unsafe_preserve_version_counter as unsafe_preserve_version_counter,
    )
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError as _exc:  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name("hp-fsdp", _exc.name or str(_exc)) from _exc

__all__ = [
    "PRIVATE_NAMES",
    "AsyncCollectiveTensor",
    "DTensorSpec",
    "StridedShard",
    "TensorMeta",
    "concatenate_meshes",
    "current_graph_task_id",
    "disable_functorch",
    "flatten_mesh",
    "functorch_transforms_active",
    "local_tensor",
    "no_grad_call",
    "profiler_enabled",
    "queue_engine_callback",
    "symm_mem_empty",
    "symm_mem_get_backend",
    "symm_mem_rendezvous",
    "symm_mem_set_backend",
    "unsafe_preserve_version_counter",
]

_PACKAGE = "hp-fsdp"

#: ``DeviceMesh._concatenate``: one mesh from meshes of the same root (HSDP's replicate x shard).
concatenate_meshes: Callable[..., Any] = require(
    _PACKAGE, "torch.distributed.device_mesh.DeviceMesh._concatenate"
)
#: The autograd engine's id of the backward running now (-1 outside backward).
current_graph_task_id: Callable[[], int] = require(_PACKAGE, "torch._C._current_graph_task_id")
#: Whether a functorch transform (``torch.func.jvp``, ``vmap``) is active.
functorch_transforms_active: Callable[[], bool] = require(
    _PACKAGE, "torch._C._are_functorch_transforms_active"
)
#: A context manager switching functorch transforms off inside it.
disable_functorch: Callable[[], Any] = require(_PACKAGE, "torch._C._DisableFuncTorch")
#: Whether the autograd profiler (``torch.profiler.profile``, ``emit_nvtx``) records on this
#: thread: a C function, cheap enough to ask before every profiler range.
profiler_enabled: Callable[[], bool] = require(_PACKAGE, "torch.autograd._profiler_enabled")
#: Switch grad mode on this thread: a C function (``torch.no_grad`` is a Python context
#: manager whose decorator form costs about eight Python calls per call of the function).
set_grad_mode: Callable[[bool], None] = require(_PACKAGE, "torch._C._set_grad_enabled")
#: The autograd engine's "run this when the current backward ends".
queue_engine_callback: Callable[[Callable[[], None]], None] = require(
    _PACKAGE, "torch.autograd.Variable._execution_engine.queue_callback"
)
symm_mem_empty: Callable[..., torch.Tensor] = require(
    _PACKAGE, "torch.distributed._symmetric_memory.empty"
)
#: Collective: maps a ``symm_mem_empty`` buffer into every rank of a group (once per buffer).
symm_mem_rendezvous: Callable[..., Any] = require(
    _PACKAGE, "torch.distributed._symmetric_memory.rendezvous"
)
symm_mem_set_backend: Callable[[str], None] = require(
    _PACKAGE, "torch.distributed._symmetric_memory.set_backend"
)
symm_mem_get_backend: Callable[[torch.device], str | None] = require(
    _PACKAGE, "torch.distributed._symmetric_memory.get_backend"
)

PRIVATE_NAMES = (
    "torch.autograd.grad_mode._unsafe_preserve_version_counter",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch._C._current_graph_task_id",
    "torch._C._set_grad_enabled",
    "torch._C._are_functorch_transforms_active",
    "torch._C._DisableFuncTorch",
    "torch.distributed.device_mesh.DeviceMesh._concatenate",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch.autograd._profiler_enabled",
    "torch.distributed._symmetric_memory.empty",
    "torch.distributed._symmetric_memory.rendezvous",
    "torch.distributed._symmetric_memory.set_backend",
    "torch.distributed._symmetric_memory.get_backend",
)


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def no_grad_call(fn: _Fn) -> _Fn:
    """``fn`` run with grad mode off, like ``@torch.no_grad()`` at one Python call's cost.

    For the per-step hot path (collectives and gradient writes, called once per unit per step):
    grad mode is read and switched with PyTorch's C functions and restored on exit.

    Args:
        fn: the function.

    Returns:
        The wrapped function.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        set_grad_mode(False)
        try:
            return fn(*args, **kwargs)
        finally:
            set_grad_mode(True)

    return cast(_Fn, run)
