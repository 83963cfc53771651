"""Ascend NPU kernels (PrivateUse1 dispatch key) calling ``torch_npu`` fused ops.

Registered at import of :mod:`hp_kernels` when ``torch_npu`` is installed (``pip install
hp-kernels[npu]``, which needs CANN); ``torch_npu`` is imported only when a kernel runs, so
this module imports anywhere. Ops without a ``torch_npu`` fused counterpart keep the reference
kernel, which runs on the NPU through ordinary torch ops:

================================  ===============================================
op                                NPU kernel
================================  ===============================================
``permute_tokens``                ``torch_npu.npu_moe_token_permute`` (2-D tokens)
``unpermute_tokens``              ``torch_npu.npu_moe_token_unpermute`` (2-D tokens)
``mega_moe``, ``mega_moe_grad``   reference (no fused ``torch_npu`` op with this contract;
                                  masked per-expert GEMMs on the NPU)
all other ops                     reference (torch ops on the NPU)
================================  ===============================================

Both fused ops follow the same contract as the reference (stable sort of the flattened
``[T, k]`` expert indices; row ``j`` is token ``sorted_indices[j] // k``; the combine sums
the ``k`` weighted rows of each token). Not yet run on Ascend hardware: their tests skip
without an NPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from hp_kernels._dispatch_keys import PRIVATEUSE1_DEVICE_TYPE
from hp_kernels._library import REFERENCE_KERNELS, ShippedKernels

__all__: list[str] = []

#: The ``torch_npu`` module name (the Ascend PyTorch plugin).
TORCH_NPU = "torch_npu"


def torch_npu_available() -> bool:
    """Whether ``torch_npu`` is installed (checked without importing it or CANN)."""
    return importlib.util.find_spec(TORCH_NPU) is not None


def _torch_npu() -> Any:
    return importlib.import_module(TORCH_NPU)


def permute_tokens(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hp_kernels::permute_tokens`` through ``torch_npu.npu_moe_token_permute``."""
    if tokens.dim() != 2:
        result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = REFERENCE_KERNELS[
            "permute_tokens"
        ](tokens, expert_indices, num_experts)
        return result
    permuted, sorted_indices = _torch_npu().npu_moe_token_permute(tokens, expert_indices)
    counts = torch.bincount(expert_indices.reshape(-1), minlength=num_experts)
    return permuted, sorted_indices.to(torch.int64), counts


def unpermute_tokens(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """``hp_kernels::unpermute_tokens`` through ``torch_npu.npu_moe_token_unpermute``."""
    if permuted_tokens.dim() != 2 or (probs is None and topk != 1):
        # Without probs the fused op only handles k = 1 (it infers k from probs).
        result: torch.Tensor = REFERENCE_KERNELS["unpermute_tokens"](
            permuted_tokens, sorted_indices, probs, topk
        )
        return result
    weights = None if probs is None else probs.reshape(-1, topk).to(permuted_tokens.dtype)
    combined: torch.Tensor = _torch_npu().npu_moe_token_unpermute(
        permuted_tokens, sorted_indices.to(torch.int32), weights
    )
    return combined


#: The NPU kernel of each op that has one.
NPU_KERNELS: dict[str, Callable[..., Any]] = {
    "permute_tokens": permute_tokens,
    "unpermute_tokens": unpermute_tokens,
}


def register(shipped: ShippedKernels) -> None:
    """Register the NPU kernels for the PrivateUse1 key when ``torch_npu`` is installed."""
    if not torch_npu_available():
        return
    for op_name, kernel in NPU_KERNELS.items():
        shipped.register(op_name, PRIVATEUSE1_DEVICE_TYPE, kernel)
