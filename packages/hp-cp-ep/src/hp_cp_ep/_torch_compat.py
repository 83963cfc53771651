"""Every private PyTorch name hp-cp-ep uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version (the checker is hp-dtensor's).
``scripts/tests/test_torch_compat.py`` lists these names.

``torch._grouped_mm`` is one GEMM over variable-size row groups, one weight matrix per group
(where it applies is decided per call by ``hp_cp_ep.grouped_mm_supported``).
``torch._C._current_graph_task_id`` tells whether code runs inside a backward pass (an activation
checkpoint recomputing the forward): ``-1`` outside one.
``torch._C._nn.scaled_dot_product_attention`` is SDPA itself, whatever
``F.scaled_dot_product_attention`` is routed to while context parallel runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hp_dtensor._torch_compat import require

__all__ = ["PRIVATE_NAMES", "grouped_mm", "in_backward", "outside_backward", "single_device_sdpa"]

_PACKAGE = "hp-cp-ep"

grouped_mm: Callable[..., torch.Tensor] = require(_PACKAGE, "torch._grouped_mm")
_current_graph_task_id: Callable[[], int] = require(_PACKAGE, "torch._C._current_graph_task_id")
single_device_sdpa: Callable[..., torch.Tensor] = require(
    _PACKAGE, "torch._C._nn.scaled_dot_product_attention"
)

PRIVATE_NAMES = (
    "torch._grouped_mm",
    "torch._C._current_graph_task_id",
    "torch._C._nn.scaled_dot_product_attention",
)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread right now."""
    return int(_current_graph_task_id()) != -1


@torch.library.custom_op("hp_cp_ep::outside_backward", mutates_args=())
def outside_backward(like: torch.Tensor) -> torch.Tensor:
    """``1`` outside a backward pass, ``0`` inside one, as a 0-d tensor like ``like``.

    The form of :func:`in_backward` that compiled graphs keep: dynamo cannot trace the graph-task
    id, but it keeps this opaque op, which reads it each time the graph runs (an activation
    checkpoint recomputing a compiled block runs it inside the backward). No host sync: the
    value is written into a new tensor.
    """
    return torch.full((), 0 if in_backward() else 1, dtype=like.dtype, device=like.device)


@outside_backward.register_fake
def _outside_backward_fake(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(())
