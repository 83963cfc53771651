"""PyTorch internals the expert-parallel code uses, reached in one place and checked once.

``torch._grouped_mm`` (one GEMM over variable-size row groups, one weight matrix per group) is
private. It is looked up when first needed; a torch without it makes every grouped-matmul request
fall back to the per-expert loop (see ``GroupedExperts``), never fail.
``torch._C._current_graph_task_id`` tells whether code runs inside a backward pass (an activation
checkpoint recomputing the forward); without it the answer is "no".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

__all__ = ["grouped_mm_op", "in_backward"]

GroupedMM = Callable[..., torch.Tensor]


def grouped_mm_op() -> GroupedMM | None:
    """``torch._grouped_mm`` when this torch has it, else ``None``."""
    op = getattr(torch, "_grouped_mm", None)
    return cast(GroupedMM, op) if callable(op) else None


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread right now."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return callable(task_id) and int(task_id()) != -1
