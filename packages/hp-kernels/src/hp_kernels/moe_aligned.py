"""MoE token permutation with every expert's group padded to an alignment (grouped GEMMs).

Grouped-GEMM kernels want each expert's group of rows to start at a multiple of an alignment
(e.g. 8 or 16 rows). :func:`permute_tokens_aligned` groups the routed (token, choice) copies by
expert exactly like :func:`hp_kernels.permute_tokens` (stable in token, then choice order) and
pads each expert's group with zero rows up to a multiple of ``alignment``. The output has the
static size ``T * k + num_experts * (alignment - 1)`` rows (the most the padding can need, as
TorchTitan sizes it), so shapes do not depend on the routing; rows past the last group are zero.
:func:`unpermute_tokens_aligned` gathers every choice's row back through the returned positions
and combines them, weighted, in choice order (deterministic, no scatter-add).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from hp_kernels._library import call, define_op, needs_autograd
from hp_kernels.moe import checked_expert_indices, combine_choices, expert_counts, run_checked

__all__ = ["permute_tokens_aligned", "unpermute_tokens_aligned"]


def aligned_capacity(num_choices: int, num_experts: int, alignment: int) -> int:
    """Rows of the aligned layout: every choice plus the most padding the groups can need."""
    return num_choices + num_experts * (alignment - 1)


@define_op("permute_tokens_aligned")
def _permute_aligned_op(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    topk = expert_indices.shape[1]
    sorted_indices, rows, padded = aligned_layout(expert_indices, num_experts, alignment)
    capacity = aligned_capacity(rows.numel(), num_experts, alignment)
    out = tokens.new_zeros((capacity, *tokens.shape[1:]))
    src = tokens.index_select(0, torch.div(sorted_indices, topk, rounding_mode="floor"))
    out.index_copy_(0, rows, src)
    positions = torch.empty_like(rows).scatter_(0, sorted_indices, rows)
    return out, positions, padded


def aligned_layout(
    expert_indices: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_indices, rows, padded_counts)`` of the aligned layout (integer ops only).

    ``sorted_indices`` is the stable expert order of the flattened choices; ``rows[j]`` is the
    row of the ``j``-th of them in the padded layout.
    """
    flat = expert_indices.reshape(-1)
    sorted_indices = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    padded = torch.div(counts + (alignment - 1), alignment, rounding_mode="floor") * alignment
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    experts = flat.index_select(0, sorted_indices)
    arange = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    return sorted_indices, arange + shift.index_select(0, experts), padded


@_permute_aligned_op.register_fake
def _(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = expert_indices.numel()
    capacity = aligned_capacity(n, num_experts, alignment)
    out = tokens.new_empty((capacity, *tokens.shape[1:]))
    positions = expert_indices.new_empty((n,), dtype=torch.int64)
    padded = expert_indices.new_empty((num_experts,), dtype=torch.int64)
    return out, positions, padded


def _permute_aligned_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tokens, expert_indices, _, _ = inputs
    _, positions, _ = output
    ctx.topk = expert_indices.shape[1]
    ctx.num_tokens = tokens.shape[0]
    ctx.save_for_backward(positions)


def _permute_aligned_backward(ctx: Any, g_out: torch.Tensor, _g_pos: Any, _g_cnt: Any) -> Any:
    (positions,) = ctx.saved_tensors
    rows = g_out.index_select(0, positions)  # padding rows get no gradient
    return rows.view(ctx.num_tokens, ctx.topk, *g_out.shape[1:]).sum(1), None, None, None


_permute_aligned_op.register_autograd(
    _permute_aligned_backward, setup_context=_permute_aligned_setup
)


@define_op("combine_tokens")
def _combine_op(
    rows: torch.Tensor, positions: torch.Tensor, probs: torch.Tensor | None, topk: int
) -> torch.Tensor:
    num_tokens = positions.numel() // topk
    per_choice = rows.index_select(0, positions).view(num_tokens, topk, *rows.shape[1:])
    return combine_choices(per_choice, probs)


@_combine_op.register_fake
def _(
    rows: torch.Tensor, positions: torch.Tensor, probs: torch.Tensor | None, topk: int
) -> torch.Tensor:
    return rows.new_empty((positions.shape[0] // topk, *rows.shape[1:]))


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    rows, positions, probs, topk = inputs
    ctx.topk = topk
    ctx.num_rows = rows.shape[0]
    ctx.has_probs = probs is not None
    ctx.save_for_backward(rows, positions, probs)


def _combine_backward(ctx: Any, g_out: torch.Tensor) -> tuple[Any, ...]:
    rows, positions, probs = ctx.saved_tensors
    topk = ctx.topk
    num_tokens = g_out.shape[0]
    g_flat = g_out.reshape(num_tokens, 1, -1)
    g_probs = None
    if ctx.has_probs:
        weights = probs.to(g_out.dtype).reshape(num_tokens, topk, 1)
        g_choice = weights * g_flat
        per_choice = rows.index_select(0, positions).reshape(num_tokens, topk, -1)
        g_probs = torch.bmm(per_choice, g_flat.transpose(1, 2)).to(probs.dtype).reshape(probs.shape)
    else:
        g_choice = g_flat.expand(num_tokens, topk, g_flat.shape[-1])
    g_rows = g_out.new_zeros((ctx.num_rows, *g_out.shape[1:]))
    # Positions are distinct (one row per choice), so this scatter writes each row once.
    g_rows.index_copy_(0, positions, g_choice.reshape(num_tokens * topk, *g_out.shape[1:]))
    return g_rows, None, g_probs, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


def permute_tokens_aligned(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routed token copies by expert, each group padded with zero rows to ``alignment``.

    The order inside a group is :func:`hp_kernels.permute_tokens`'s (token, then choice); expert
    ``e``'s group starts at ``sum(padded_counts[:e])``, a multiple of ``alignment``.

    Args:
        tokens: ``[T, ...]`` token activations.
        expert_indices: ``[T]`` or ``[T, k]`` integer expert index per token choice.
        num_experts: Number of experts.
        alignment: Row alignment of every group (1: no padding, the rows of
            :func:`hp_kernels.permute_tokens` followed by nothing).

    Returns:
        ``(permuted, positions, padded_counts)``: ``permuted`` has
        ``T * k + num_experts * (alignment - 1)`` rows (zero where not a routed copy);
        ``positions`` (int64, ``[T * k]``) is the row of each flattened (token, choice) in
        ``permuted``, what :func:`unpermute_tokens_aligned` needs; ``padded_counts`` (int64,
        ``[num_experts]``) are the group sizes, multiples of ``alignment``. Differentiable in
        ``tokens``.

    Raises:
        ValueError: If shapes disagree, ``num_experts`` or ``alignment`` is not positive, or (on
            the CPU) an index is out of range (no host sync checks it: on an accelerator an
            out-of-range index fails a device-side assertion).
        TypeError: If ``expert_indices`` is not an integer tensor.

    Example:
        >>> import torch
        >>> from hp_kernels import permute_tokens_aligned
        >>> x = torch.tensor([[1.0], [2.0], [3.0]])
        >>> p, pos, cnt = permute_tokens_aligned(x, torch.tensor([1, 0, 1]), 2, 2)
        >>> p.flatten().tolist(), pos.tolist(), cnt.tolist()
        ([2.0, 0.0, 1.0, 3.0, 0.0], [2, 0, 3], [2, 2])

    See Also:
        :titan:`torchtitan.models.moe.utils.generate_permute_indices`: TorchTitan's aligned
        permutation for grouped GEMMs.
    """
    if num_experts < 1 or alignment < 1:
        raise ValueError(
            f"num_experts and alignment must be positive, got {num_experts} and {alignment}"
        )
    idx = checked_expert_indices(tokens, expert_indices, num_experts)
    args = (tokens, idx, num_experts, alignment)
    if needs_autograd(tokens):
        result = run_checked(lambda: _permute_aligned_op(*args), idx, num_experts)
    else:
        result = run_checked(lambda: call(_permute_aligned_op, [tokens], *args), idx, num_experts)
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], result)


def unpermute_tokens_aligned(
    permuted_tokens: torch.Tensor,
    positions: torch.Tensor,
    probs: torch.Tensor | None = None,
    topk: int | None = None,
) -> torch.Tensor:
    """Combine each token's ``k`` expert rows from the aligned layout, in choice order.

    ``out[t] = sum_c w[t, c] * permuted_tokens[positions[t * k + c]]`` with ``w`` = ``probs``
    (or 1); padding rows are never read.

    Args:
        permuted_tokens: Expert outputs in the layout of :func:`permute_tokens_aligned`.
        positions: The ``positions`` it returned (``[T * k]``).
        probs: Optional ``[T, k]`` (or ``[T]``) routing weights.
        topk: Choices per token; inferred from ``probs`` when given, else 1.

    Returns:
        ``[T, ...]`` combined outputs. Differentiable in ``permuted_tokens`` and ``probs``.

    Raises:
        ValueError: If the sizes are inconsistent.

    See Also:
        :titan:`torchtitan.models.moe.moe.MoE`: TorchTitan scatters the aligned expert outputs back
        with ``permuted_indices``.
    """
    if probs is not None:
        k = 1 if probs.dim() == 1 else probs.shape[-1]
        if topk is not None and topk != k:
            raise ValueError(f"topk={topk} disagrees with probs of shape {tuple(probs.shape)}")
        topk = k
    topk = 1 if topk is None else topk
    n = positions.numel()
    if topk < 1 or positions.dim() != 1 or n % topk:
        raise ValueError(
            f"positions must be 1-D with a multiple of topk={topk} entries, "
            f"got shape {tuple(positions.shape)}"
        )
    if permuted_tokens.dim() < 1:
        raise ValueError("permuted_tokens must have a leading row dimension")
    if probs is not None and probs.numel() != n:
        raise ValueError(f"probs must have T * k = {n} elements, got shape {tuple(probs.shape)}")
    args = (permuted_tokens, positions.to(torch.int64), probs, topk)
    if needs_autograd(permuted_tokens, probs):
        result = _combine_op(*args)
    else:
        result = call(_combine_op, [permuted_tokens], *args)
    return cast(torch.Tensor, result)
