"""MoE token permutation ops for expert parallelism.

:func:`permute_tokens` groups the (token, choice) pairs of a top-k router by expert, stable in
token order, so each expert's tokens are contiguous (ready for a grouped GEMM or an all-to-all
split by ``tokens_per_expert``). :func:`unpermute_tokens` scatters them back and combines the
``k`` expert outputs of every token, optionally weighted by the router probabilities. Both are
``torch.library`` custom ops with autograd, and neither synchronizes the host with the device
(no ``.item()``, ``bincount`` or range check reading indices on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from hp_kernels._dispatch_keys import META_DEVICE_TYPE
from hp_kernels._library import call, define_op, needs_autograd

__all__ = ["permute_tokens", "unpermute_tokens"]


@define_op("permute_tokens")
def _permute_tokens_op(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    topk = expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    sorted_indices = torch.sort(flat, stable=True).indices
    permuted = tokens.index_select(0, torch.div(sorted_indices, topk, rounding_mode="floor"))
    return permuted, sorted_indices, expert_counts(flat, num_experts)


@_permute_tokens_op.register_fake
def _(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = expert_indices.numel()
    permuted = tokens.new_empty((n, *tokens.shape[1:]))
    sorted_indices = expert_indices.new_empty((n,), dtype=torch.int64)
    counts = expert_indices.new_empty((num_experts,), dtype=torch.int64)
    return permuted, sorted_indices, counts


def _permute_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tokens, expert_indices, _ = inputs
    _, sorted_indices, _ = output
    ctx.topk = expert_indices.shape[1]
    ctx.num_tokens = tokens.shape[0]
    ctx.save_for_backward(sorted_indices)


def _permute_backward(ctx: Any, g_perm: torch.Tensor, _g_idx: Any, _g_cnt: Any) -> tuple[Any, ...]:
    (sorted_indices,) = ctx.saved_tensors
    unsorted = torch.empty_like(g_perm).index_copy_(0, sorted_indices, g_perm)
    g_tokens = unsorted.view(ctx.num_tokens, ctx.topk, *g_perm.shape[1:]).sum(1)
    return g_tokens, None, None


_permute_tokens_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def checked_expert_indices(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """``expert_indices`` as ``[T, k]`` int64 after checking dtype and shape (host metadata).

    The range of the values is checked by :func:`expert_counts` inside the permutation, without
    a host sync.

    Raises:
        TypeError: The indices are not integers.
        ValueError: ``tokens`` has no token dim, or the indices are not ``[T]`` / ``[T, k]``.
    """
    if expert_indices.dtype.is_floating_point or expert_indices.dtype.is_complex:
        raise TypeError(f"expert_indices must be an integer tensor, got {expert_indices.dtype}")
    if tokens.dim() < 1:
        raise ValueError("tokens must have a leading token dimension")
    idx = expert_indices.unsqueeze(1) if expert_indices.dim() == 1 else expert_indices
    if idx.dim() != 2 or idx.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"expert_indices must be [T] or [T, k] with T = {tokens.shape[0]}, "
            f"got shape {tuple(expert_indices.shape)}"
        )
    return idx.to(torch.int64)


def expert_counts(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64 count of each expert index in ``flat_indices`` (no host sync).

    A scatter-add of ones, not ``torch.bincount`` (which reads the largest index on the host to
    size its output on an accelerator). The scatter also checks the range of every index: out of
    ``[0, num_experts)`` it raises on the CPU and fails a device-side assertion on accelerators,
    so the permutations need no separate range check (whose ``min``/``max`` would be two more
    host syncs per call). Integer sums: exact and deterministic on every device.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_indices.device)
    return counts.scatter_add_(0, flat_indices, torch.ones_like(flat_indices, dtype=torch.int64))


def raise_if_out_of_range(expert_indices: torch.Tensor, num_experts: int) -> None:
    """Raise the ``ValueError`` naming the range of ``expert_indices`` when some index is outside
    ``[0, num_experts)``; used on the error path only (it reads the indices on the host)."""
    if expert_indices.numel() and expert_indices.device.type != META_DEVICE_TYPE:
        lo, hi = int(expert_indices.min()), int(expert_indices.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert indices must lie in [0, {num_experts}), got [{lo}, {hi}]")


def run_checked(op_call: Callable[[], Any], expert_indices: torch.Tensor, num_experts: int) -> Any:
    """Run a permutation; when it fails, name out-of-range expert indices as a ``ValueError``."""
    try:
        return op_call()
    except RuntimeError:
        raise_if_out_of_range(expert_indices, num_experts)
        raise


def permute_tokens(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routed token copies by expert.

    For ``T`` tokens each routed to ``k`` experts, the ``T * k`` copies are sorted by expert
    index, stably (within an expert, in token order, then choice order).

    Args:
        tokens: ``[T, ...]`` token activations.
        expert_indices: ``[T]`` or ``[T, k]`` integer expert index per token choice, each in
            ``[0, num_experts)``.
        num_experts: Number of experts (length of the returned counts).

    Returns:
        ``(permuted_tokens, sorted_indices, tokens_per_expert)``: ``permuted_tokens`` is
        ``[T * k, ...]`` with row ``j`` equal to ``tokens[sorted_indices[j] // k]``;
        ``sorted_indices`` (int64, ``[T * k]``) indexes the flattened ``[T, k]`` choices and is
        what :func:`unpermute_tokens` needs; ``tokens_per_expert`` (int64, ``[num_experts]``)
        counts rows per expert. Differentiable in ``tokens``.

    Raises:
        ValueError: If shapes disagree, ``num_experts`` is not positive, or (on the CPU) an index
            is out of range. No host sync checks the range: on an accelerator an out-of-range
            index fails a device-side assertion of the counting scatter.
        TypeError: If ``expert_indices`` is not an integer tensor.

    Example:
        >>> import torch
        >>> from hp_kernels import permute_tokens
        >>> x = torch.tensor([[1.0], [2.0], [3.0]])
        >>> p, idx, cnt = permute_tokens(x, torch.tensor([1, 0, 1]), 2)
        >>> p.flatten().tolist(), cnt.tolist()
        ([2.0, 1.0, 3.0], [1, 2])

    See Also:
        :titan:`torchtitan.models.moe.moe.TokenReorderer`: TorchTitan's reordering of routed tokens
        by expert.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    idx = checked_expert_indices(tokens, expert_indices, num_experts)
    args = (tokens, idx, num_experts)
    if needs_autograd(tokens):
        result = run_checked(lambda: _permute_tokens_op(*args), idx, num_experts)
    else:
        result = run_checked(lambda: call(_permute_tokens_op, [tokens], *args), idx, num_experts)
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], result)


def combine_choices(per_choice: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Sum ``[T, k, ...]`` expert outputs over the k choices, weighted by ``probs`` ``[T, k]``."""
    num_tokens, topk = per_choice.shape[0], per_choice.shape[1]
    if probs is None:
        return per_choice.sum(1)
    weights = probs.to(per_choice.dtype).reshape(num_tokens, 1, topk)
    flat = per_choice.reshape(num_tokens, topk, -1)
    return torch.bmm(weights, flat).view(num_tokens, *per_choice.shape[2:])


def _per_choice(
    permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, topk: int
) -> torch.Tensor:
    """``[T, k, ...]`` view of the rows back in (token, choice) order."""
    # The inverse permutation by one integer scatter (the tensor op, not ``inverse[idx] = ...``
    # indexing, whose Python path costs more here), then one row gather (faster on CPU than a
    # row ``index_copy_`` scatter).
    n = sorted_indices.numel()
    positions = torch.arange(n, device=sorted_indices.device, dtype=sorted_indices.dtype)
    inverse = torch.empty_like(sorted_indices).scatter_(0, sorted_indices, positions)
    rows = permuted_tokens.index_select(0, inverse)
    return rows.view(permuted_tokens.shape[0] // topk, topk, *permuted_tokens.shape[1:])


@define_op("unpermute_tokens")
def _unpermute_tokens_op(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    return combine_choices(_per_choice(permuted_tokens, sorted_indices, topk), probs)


@_unpermute_tokens_op.register_fake
def _(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    return permuted_tokens.new_empty((permuted_tokens.shape[0] // topk, *permuted_tokens.shape[1:]))


def _unpermute_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    permuted_tokens, sorted_indices, probs, topk = inputs
    ctx.topk = topk
    ctx.has_probs = probs is not None
    if probs is not None:
        ctx.save_for_backward(permuted_tokens, sorted_indices, probs)
    else:
        ctx.save_for_backward(sorted_indices)


def _unpermute_backward(ctx: Any, g_out: torch.Tensor) -> tuple[Any, ...]:
    topk = ctx.topk
    num_tokens = g_out.shape[0]
    g_flat = g_out.reshape(num_tokens, 1, -1)
    g_probs = None
    if ctx.has_probs:
        permuted_tokens, sorted_indices, probs = ctx.saved_tensors
        weights = probs.to(g_out.dtype).reshape(num_tokens, topk, 1)
        g_choice = weights * g_flat  # [T, k, H]
        per_choice = _per_choice(permuted_tokens, sorted_indices, topk).reshape(
            num_tokens, topk, -1
        )
        g_probs = torch.bmm(per_choice, g_flat.transpose(1, 2)).to(probs.dtype).reshape(probs.shape)
    else:
        (sorted_indices,) = ctx.saved_tensors
        g_choice = g_flat.expand(num_tokens, topk, g_flat.shape[-1])
    rows = g_choice.reshape(num_tokens * topk, *g_out.shape[1:])
    return rows.index_select(0, sorted_indices), None, g_probs, None


_unpermute_tokens_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute_tokens(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    topk: int | None = None,
) -> torch.Tensor:
    """Restore token order and combine each token's ``k`` expert outputs.

    Inverse of :func:`permute_tokens`: ``out[t] = sum_c w[t, c] * x[pos(t, c)]`` where
    ``pos(t, c)`` is the row of choice ``(t, c)`` in ``permuted_tokens`` and ``w`` is ``probs``
    (or 1). The rows are gathered back to (token, choice) order and combined by a batched matmul
    with the weights (a plain sum without ``probs``): no scatter-add and no atomics, so the result
    is deterministic on every device.

    Args:
        permuted_tokens: ``[T * k, ...]`` expert outputs in permuted order.
        sorted_indices: The ``sorted_indices`` returned by :func:`permute_tokens`.
        probs: Optional ``[T, k]`` (or ``[T]`` for ``k = 1``) routing weights.
        topk: Choices per token; inferred from ``probs`` when given, else defaults to 1.

    Returns:
        ``[T, ...]`` combined outputs. Differentiable in ``permuted_tokens`` and ``probs``.

    Raises:
        ValueError: If the sizes are inconsistent.

    Example:
        >>> import torch
        >>> from hp_kernels import permute_tokens, unpermute_tokens
        >>> x = torch.randn(4, 3)
        >>> p, idx, _ = permute_tokens(x, torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]]), 2)
        >>> torch.equal(unpermute_tokens(p, idx, topk=2), 2 * x)
        True

    See Also:
        :titan:`torchtitan.models.moe.moe.MoE`: TorchTitan's MoE layer, which scatters routed expert
        outputs back to token order.
    """
    if probs is not None:
        k = 1 if probs.dim() == 1 else probs.shape[-1]
        if topk is not None and topk != k:
            raise ValueError(f"topk={topk} disagrees with probs of shape {tuple(probs.shape)}")
        topk = k
    topk = 1 if topk is None else topk
    if topk < 1:
        raise ValueError(f"topk must be positive, got {topk}")
    n = permuted_tokens.shape[0] if permuted_tokens.dim() else 0
    if permuted_tokens.dim() < 1 or n % topk != 0:
        raise ValueError(
            f"permuted_tokens has {n} rows, expected a multiple of topk={topk} (T * k rows)"
        )
    if sorted_indices.shape != (n,):
        raise ValueError(
            f"sorted_indices must have shape ({n},), got {tuple(sorted_indices.shape)}"
        )
    if probs is not None and probs.numel() != n:
        raise ValueError(f"probs must have T * k = {n} elements, got shape {tuple(probs.shape)}")
    args = (permuted_tokens, sorted_indices.to(torch.int64), probs, topk)
    if needs_autograd(permuted_tokens, probs):
        result = _unpermute_tokens_op(*args)
    else:
        result = call(_unpermute_tokens_op, [permuted_tokens], *args)
    return cast(torch.Tensor, result)
