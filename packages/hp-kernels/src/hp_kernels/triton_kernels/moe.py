# Triton's DSL kernels and decorators are untyped, and CI type-checks without triton installed:
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-not-found,import-untyped"
"""Triton kernels of MoE token routing (expert parallelism), and their launchers.

- ``permute_tokens``: the row gather that groups every (token, choice) copy by expert. The
  stable sort of the expert indices and the per-expert counts stay torch ops (``torch.sort``,
  a scatter-add: no host sync); the kernel moves the rows, one program per (row, column block).
- ``unpermute_tokens``: the weighted combine back to token order. Each program owns output
  rows and reads their ``k`` expert rows through the inverse permutation, so the sum runs in
  choice order with no atomics (deterministic, like the reference).

The gather is a copy (bitwise equal to the reference). The combine accumulates in float32 with
the weights first rounded to the token dtype, as the reference does; it matches the
reference's ``bmm``/``sum`` to float32 rounding (rtol 1e-6 in float32, one bfloat16/float16
ulp), not bitwise, because ``bmm`` may fuse or reorder the ``k`` products.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hp_kernels._library import REFERENCE_KERNELS
from hp_kernels.moe import expert_counts
from hp_kernels.triton_kernels._common import block_configs, cast, supported, to_f32

__all__: list[str] = []


@triton.autotune(configs=block_configs((128, 512, 2048), 512), key=["width", "SCATTER"])
@triton.jit
def _gather_rows_kernel(
    src, rows, dest, dst, width, topk, SCATTER: tl.constexpr, BLOCK: tl.constexpr
):
    j = tl.program_id(0).to(tl.int64)
    token = tl.load(rows + j) // topk
    target = tl.load(dest + j) if SCATTER else j  # the aligned layout's row, else row j
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = c < width
    tl.store(dst + target * width + c, tl.load(src + token * width + c, mask=mask), mask=mask)


def permute_tokens(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``hp_kernels::permute_tokens`` (same signature and result)."""
    topk = expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    sorted_indices = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    src = tokens.contiguous()
    width = math.prod(tokens.shape[1:])
    permuted = tokens.new_empty((flat.numel(), *tokens.shape[1:]))
    if permuted.numel():

        def grid(cfg: dict[str, int]) -> tuple[int, int]:
            return (flat.numel(), triton.cdiv(width, cfg["BLOCK"]))

        _gather_rows_kernel[grid](
            src, sorted_indices, sorted_indices, permuted, width, topk, SCATTER=False
        )
    return permuted, sorted_indices, counts


def permute_tokens_aligned(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``hp_kernels::permute_tokens_aligned`` (same result)."""
    from hp_kernels.moe_aligned import aligned_capacity, aligned_layout

    topk = expert_indices.shape[1]
    sorted_indices, rows, padded = aligned_layout(expert_indices, num_experts, alignment)
    n = rows.numel()
    out = tokens.new_zeros((aligned_capacity(n, num_experts, alignment), *tokens.shape[1:]))
    width = math.prod(tokens.shape[1:])
    if n and width:

        def grid(cfg: dict[str, int]) -> tuple[int, int]:
            return (n, triton.cdiv(width, cfg["BLOCK"]))

        _gather_rows_kernel[grid](
            tokens.contiguous(), sorted_indices, rows, out, width, topk, SCATTER=True
        )
    positions = torch.empty_like(rows).scatter_(0, sorted_indices, rows)
    return out, positions, padded


@triton.autotune(configs=block_configs((128, 512, 2048), 512), key=["width", "TOPK"])
@triton.jit
def _combine_kernel(
    src,
    inverse,
    probs,
    dst,
    width,
    TOPK: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = c < width
    DTYPE: tl.constexpr = src.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(TOPK):
        row = tl.load(inverse + t * TOPK + choice)
        x = to_f32(tl.load(src + row * width + c, mask=mask, other=0.0))
        if WEIGHTED:
            w = to_f32(cast(tl.load(probs + t * TOPK + choice), DTYPE))
            acc += w * x
        else:
            acc += x
    tl.store(dst + t * width + c, cast(acc, DTYPE), mask=mask)


def unpermute_tokens(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """Triton launcher of ``hp_kernels::unpermute_tokens`` (same signature and result)."""
    n = sorted_indices.numel()
    positions = torch.arange(n, device=sorted_indices.device, dtype=torch.int64)
    inverse = torch.empty_like(sorted_indices).scatter_(0, sorted_indices, positions)
    return _combine(permuted_tokens, inverse, probs, topk, "unpermute_tokens", sorted_indices)


def combine_tokens(
    rows: torch.Tensor, positions: torch.Tensor, probs: torch.Tensor | None, topk: int
) -> torch.Tensor:
    """Triton launcher of ``hp_kernels::combine_tokens`` (same signature and result)."""
    return _combine(rows, positions, probs, topk, "combine_tokens", positions)


def _combine(
    permuted_tokens: torch.Tensor,
    inverse: torch.Tensor,
    probs: torch.Tensor | None,
    topk: int,
    op_name: str,
    index: torch.Tensor,
) -> torch.Tensor:
    dtypes = [permuted_tokens.dtype] + ([] if probs is None else [probs.dtype])
    if not supported(*dtypes) or topk > 16:
        result: torch.Tensor = REFERENCE_KERNELS[op_name](permuted_tokens, index, probs, topk)
        return result
    n = inverse.numel()
    num_tokens = n // topk
    src = permuted_tokens.contiguous()
    width = math.prod(permuted_tokens.shape[1:])
    out = permuted_tokens.new_empty((num_tokens, *permuted_tokens.shape[1:]))
    if out.numel():
        weights = src if probs is None else probs.contiguous()

        def grid(cfg: dict[str, int]) -> tuple[int, int]:
            return (num_tokens, triton.cdiv(width, cfg["BLOCK"]))

        _combine_kernel[grid](
            src, inverse, weights, out, width, TOPK=topk, WEIGHTED=probs is not None
        )
    return out


def launchers() -> dict[str, object]:
    """The launcher of every op this module implements, by op name."""
    return {
        "permute_tokens": permute_tokens,
        "unpermute_tokens": unpermute_tokens,
        "permute_tokens_aligned": permute_tokens_aligned,
        "combine_tokens": combine_tokens,
    }
