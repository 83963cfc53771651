"""Fused MoE feed-forward: routing permutation, grouped SwiGLU experts and the combine in one op.

:func:`mega_moe` computes, for ``T`` tokens each routed to ``k`` of ``E`` SwiGLU experts,

    out[t] = sum_c  p[t, c] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),   e = idx[t, c]

(or with the routing weight applied to the expert's *input* when ``score_before_experts``), in
one call of the custom op ``hp_kernels::mega_moe``; its backward is the custom op
``hp_kernels::mega_moe_grad`` (:func:`mega_moe_grad` is its public entry point). The layout of
the weights is :class:`hp_cp_ep.GroupedExperts`': ``w1``/``w3`` ``[E, hidden, dim]``, ``w2``
``[E, dim, hidden]``.

Kernels:

- reference (every device): the composed ops, in the order and with the arithmetic of
  :func:`~hp_kernels.permute_tokens`, ``GroupedExperts.compute`` (``torch._grouped_mm``) and
  :func:`~hp_kernels.unpermute_tokens`, so it is bitwise equal to them (forward and every
  gradient) wherever ``torch._grouped_mm`` applies (CPU in float32/bfloat16/float16 and bfloat16
  on accelerators, every row stride a multiple of 16 bytes). Elsewhere it runs one masked GEMM
  per expert over all rows (``E`` times the FLOPs, no host sync; equal up to rounding). It
  materialises the permuted copy of the tokens, as the composed ops do.
- Triton (CUDA, :mod:`hp_kernels.triton_kernels.mega_moe`): grouped GEMMs whose loads gather
  each expert's rows from the *unpermuted* tokens by index (no permuted copy of ``x``, nor of
  the gradient rows in the backward) and whose stores scatter the expert outputs back to
  (token, choice) order; verified under ``TRITON_INTERPRET=1`` against the reference.
- Ascend: the reference kernel, on the NPU through ordinary torch ops (one masked GEMM per
  expert). ``torch_npu`` has the pieces (``npu_moe_token_permute`` / ``npu_grouped_matmul`` /
  ``npu_moe_token_unpermute``) but no fused op with this contract; a kernel chaining them is
  not shipped until it can be checked on Ascend hardware.

Neither op synchronizes the host with the device: the per-expert counts are a scatter-add, the
row groups are cumulative offsets on the device, and no index is read on the host.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from hp_kernels._library import call, define_op, needs_autograd
from hp_kernels._torch_compat import grouped_mm
from hp_kernels.moe import (
    _per_choice,
    checked_expert_indices,
    combine_choices,
    expert_counts,
    run_checked,
)

__all__ = ["mega_moe", "mega_moe_grad"]

#: Every inner dimension of a ``torch._grouped_mm`` operand, in bytes, is a multiple of this.
_GROUPED_MM_ALIGN_BYTES = 16

#: Dtypes ``torch._grouped_mm`` takes on the CPU (accelerators: bfloat16 only).
_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x`` times these per-expert weights here.

    float32/bfloat16/float16 on the CPU, bfloat16 on CUDA GPUs; every inner dimension times the
    element size a multiple of 16 bytes (the rule of :func:`hp_cp_ep.grouped_mm_supported`).
    """
    dtype = x.dtype
    if x.is_cpu:
        if dtype not in _CPU_GROUPED_MM_DTYPES:
            return False
    elif not (x.is_cuda and dtype == torch.bfloat16):
        return False  # other accelerators (Ascend): the masked per-expert GEMMs
    dims = {x.shape[-1], *(d for w in weights for d in w.shape[1:])}
    return all(d * x.element_size() % _GROUPED_MM_ALIGN_BYTES == 0 for d in dims)


class _Groups:
    """The expert row groups of the sorted rows: offsets for ``torch._grouped_mm`` and the
    expert of every row (for the masked fallback). Device tensors only: no host sync."""

    def __init__(self, counts: torch.Tensor, row_expert: torch.Tensor, use_grouped_mm: bool):
        self.offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        self.row_expert = row_expert
        self.num_experts = counts.numel()
        self.grouped = use_grouped_mm

    def linear(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``rows[j] @ weight[e_j].T`` for ``weight`` ``[E, out, in]``: ``[N, out]``."""
        if self.grouped:
            return cast(torch.Tensor, grouped_mm(rows, weight.transpose(-2, -1), offs=self.offsets))
        return self._masked(rows, weight.transpose(-2, -1))

    def linear_t(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``rows[j] @ weight[e_j]`` for ``weight`` ``[E, out, in]``: ``[N, in]``."""
        if self.grouped:
            return cast(torch.Tensor, grouped_mm(rows, weight, offs=self.offsets))
        return self._masked(rows, weight)

    def weight_grad(self, grads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per expert ``e``, the sum over its rows ``j`` of ``grads[j]^T rows[j]``.

        Returns ``[E, grads.shape[1], rows.shape[1]]``.
        """
        if self.grouped:
            return cast(torch.Tensor, grouped_mm(grads.t(), rows, offs=self.offsets))
        out = []
        for e in range(self.num_experts):
            mask = (self.row_expert == e).unsqueeze(-1)
            out.append(torch.where(mask, grads, 0).t() @ rows)
        return torch.stack(out)

    def _masked(self, rows: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros((rows.shape[0], mats.shape[-1]))
        for e in range(self.num_experts):
            mask = (self.row_expert == e).unsqueeze(-1)
            out = torch.where(mask, rows @ mats[e], out)
        return out


def _layout(
    expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_indices, counts, row_expert)`` of the flattened ``[T, k]`` choices."""
    flat = expert_indices.reshape(-1)
    ordered = torch.sort(flat, stable=True)
    return ordered.indices, expert_counts(flat, num_experts), ordered.values


def _rows(
    x: torch.Tensor,
    sorted_indices: torch.Tensor,
    topk: int,
    probs: torch.Tensor | None,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The experts' input rows in sorted order (and the per-row weight when pre-scaled)."""
    rows = x.index_select(0, torch.div(sorted_indices, topk, rounding_mode="floor"))
    if not score_before_experts:
        return rows, None
    assert probs is not None
    row_weight = probs.reshape(-1)[sorted_indices].unsqueeze(-1)
    return rows, row_weight


@define_op("mega_moe")
def _mega_moe_op(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, topk = expert_indices.shape
    sorted_indices, counts, row_expert = _layout(expert_indices, w1.shape[0])
    rows, row_weight = _rows(x, sorted_indices, topk, probs, score_before_experts)
    if row_weight is not None:
        rows = rows * row_weight
    groups = _Groups(counts, row_expert, grouped_mm_applies(rows, w1, w2, w3))
    gate = groups.linear(rows, w1)
    up = groups.linear(rows, w3)
    expert_out = groups.linear(F.silu(gate) * up, w2)
    per_choice = _per_choice(expert_out, sorted_indices, topk)
    weighted = probs is not None and not score_before_experts
    out = combine_choices(per_choice, probs if weighted else None)
    # The backward needs the experts' outputs (choice order) only for the gradient of probs.
    saved_out = per_choice.reshape(num_tokens * topk, -1) if weighted else x.new_empty((0,))
    return out, sorted_indices, counts, gate, up, saved_out


@_mega_moe_op.register_fake
def _(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = expert_indices.numel()
    hidden = w1.shape[1]
    weighted = probs is not None and not score_before_experts
    return (
        x.new_empty(x.shape),
        expert_indices.new_empty((n,), dtype=torch.int64),
        expert_indices.new_empty((w1.shape[0],), dtype=torch.int64),
        x.new_empty((n, hidden)),
        x.new_empty((n, hidden)),
        x.new_empty((n, x.shape[1]) if weighted else (0,)),
    )


@define_op("mega_moe_grad")
def _mega_moe_grad_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    sorted_indices: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    expert_out: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The backward of the composed ops, formula by formula in autograd's order (bitwise equal).
    num_tokens, topk = expert_indices.shape
    dim = x.shape[1]
    weighted = probs is not None and not score_before_experts
    g_flat = grad_out.reshape(num_tokens, 1, dim)
    g_probs = x.new_empty((0,))
    if weighted:
        assert probs is not None
        g_choice = probs.reshape(num_tokens, topk, 1) * g_flat
        per_choice = expert_out.reshape(num_tokens, topk, dim)
        g_probs = torch.bmm(per_choice, g_flat.transpose(1, 2)).reshape(probs.shape)
    else:
        g_choice = g_flat.expand(num_tokens, topk, dim)
    g_expert_out = g_choice.reshape(num_tokens * topk, dim).index_select(0, sorted_indices)
    row_expert = expert_indices.reshape(-1).index_select(0, sorted_indices)
    rows, row_weight = _rows(x, sorted_indices, topk, probs, score_before_experts)
    groups = _Groups(counts, row_expert, grouped_mm_applies(x, w1, w2, w3))
    activated = F.silu(gate)
    g_hidden = groups.linear_t(g_expert_out, w2)
    g_w2 = groups.weight_grad(g_expert_out, activated * up)
    g_gate = torch.ops.aten.silu_backward(g_hidden * up, gate)
    g_up = g_hidden * activated
    expert_in = rows if row_weight is None else rows * row_weight
    g_w1 = groups.weight_grad(g_gate, expert_in)
    g_w3 = groups.weight_grad(g_up, expert_in)
    g_rows = groups.linear_t(g_gate, w1) + groups.linear_t(g_up, w3)
    if row_weight is not None:
        assert probs is not None
        g_row_weight = (g_rows * rows).sum(-1, keepdim=True)
        g_rows = g_rows * row_weight
        g_probs = (
            torch.zeros(probs.numel(), dtype=probs.dtype, device=probs.device)
            .index_put_((sorted_indices,), g_row_weight.squeeze(-1), accumulate=True)
            .view(probs.shape)
        )
    unsorted = torch.empty_like(g_rows).index_copy_(0, sorted_indices, g_rows)
    g_x = unsorted.view(num_tokens, topk, dim).sum(1)
    return g_x, g_probs, g_w1, g_w2, g_w3


@_mega_moe_grad_op.register_fake
def _(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    sorted_indices: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    expert_out: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g_probs = x.new_empty((0,)) if probs is None else probs.new_empty(probs.shape)
    return (
        x.new_empty(x.shape),
        g_probs,
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
        w3.new_empty(w3.shape),
    )


def _mega_moe_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, expert_indices, probs, w1, w2, w3, score_before_experts = inputs
    _, sorted_indices, counts, gate, up, expert_out = output
    ctx.score_before_experts = score_before_experts
    ctx.has_probs = probs is not None
    ctx.set_materialize_grads(False)
    saved = (x, expert_indices, w1, w2, w3, sorted_indices, counts, gate, up, expert_out)
    ctx.save_for_backward(*saved, *((probs,) if probs is not None else ()))


def _mega_moe_backward(ctx: Any, g_out: torch.Tensor | None, *_unused: Any) -> tuple[Any, ...]:
    if g_out is None:
        return None, None, None, None, None, None, None
    x, expert_indices, w1, w2, w3, sorted_indices, counts, gate, up, expert_out, *rest = (
        ctx.saved_tensors
    )
    probs = rest[0] if ctx.has_probs else None
    g_x, g_probs, g_w1, g_w2, g_w3 = _mega_moe_grad_op(
        g_out.contiguous(),
        x,
        expert_indices,
        probs,
        w1,
        w2,
        w3,
        sorted_indices,
        counts,
        gate,
        up,
        expert_out,
        ctx.score_before_experts,
    )
    return g_x, None, g_probs if ctx.has_probs else None, g_w1, g_w2, g_w3, None


_mega_moe_op.register_autograd(_mega_moe_backward, setup_context=_mega_moe_setup)


def _checked(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the arguments (host metadata only); return ``[T, k]`` int64 indices and probs."""
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("w3", w3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not isinstance(score_before_experts, bool):
        raise TypeError(
            f"score_before_experts must be a bool, got {type(score_before_experts).__name__}"
        )
    if x.dim() != 2:
        raise ValueError(f"x must be [T, dim], got shape {tuple(x.shape)}")
    num_tokens, dim = x.shape
    if w1.dim() != 3:
        raise ValueError(f"w1 must be [E, hidden, dim], got shape {tuple(w1.shape)}")
    num_experts, hidden = w1.shape[0], w1.shape[1]
    expected = {"w1": (num_experts, hidden, dim), "w3": (num_experts, hidden, dim)}
    expected["w2"] = (num_experts, dim, hidden)
    for name, t in (("w1", w1), ("w2", w2), ("w3", w3)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"{name} must have shape {expected[name]} (E={num_experts}, hidden={hidden}, "
                f"dim={dim} from x and w1), got {tuple(t.shape)}"
            )
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")
    if num_experts < 1:
        raise ValueError(f"w1 must hold at least one expert, got shape {tuple(w1.shape)}")
    if expert_indices.device != x.device:
        raise ValueError(f"expert_indices is on {expert_indices.device}, expected {x.device}")
    idx = checked_expert_indices(x, expert_indices, num_experts)
    topk = idx.shape[1]
    if probs is None:
        if score_before_experts:
            raise ValueError("score_before_experts=True needs probs, got None")
        return idx, None
    if not probs.dtype.is_floating_point:
        raise TypeError(f"probs must be a floating-point tensor, got {probs.dtype}")
    if probs.device != x.device:
        raise ValueError(f"probs is on {probs.device}, expected x's device {x.device}")
    if tuple(probs.shape) not in ((num_tokens, topk),) + (((num_tokens,),) if topk == 1 else ()):
        raise ValueError(
            f"probs must have shape ({num_tokens}, {topk}) like expert_indices, "
            f"got {tuple(probs.shape)}"
        )
    return idx, probs.reshape(num_tokens, topk)


def mega_moe(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    score_before_experts: bool = False,
) -> torch.Tensor:
    """Routed SwiGLU experts in one fused op: permute, grouped GEMMs, SwiGLU, combine.

    ``out[t] = sum_c p[t, c] * FFN_e(x[t])`` over the ``k`` choices ``e = expert_indices[t, c]``,
    with ``FFN_e(v) = w2[e] @ (silu(w1[e] @ v) * (w3[e] @ v))``; with ``score_before_experts``
    the weight scales the expert's input instead: ``sum_c FFN_e(p[t, c] * x[t])`` (the two modes
    of :class:`hp_cp_ep.MoE`). Equal to ``permute_tokens`` + ``GroupedExperts.compute`` +
    ``unpermute_tokens`` (bitwise with the reference kernel where ``torch._grouped_mm``
    applies), differentiable in ``x``, ``probs`` and the three weights through the
    ``hp_kernels::mega_moe_grad`` op. No host sync, forward or backward.

    Args:
        x: ``[T, dim]`` tokens.
        expert_indices: ``[T, k]`` (or ``[T]``) integer expert of every choice, in ``[0, E)``.
        probs: ``[T, k]`` routing weights in ``x``'s dtype's range (cast to ``x.dtype``), or
            ``None`` for an unweighted sum of the ``k`` outputs.
        w1: ``[E, hidden, dim]`` gate projections.
        w2: ``[E, dim, hidden]`` down projections.
        w3: ``[E, hidden, dim]`` up projections.
        score_before_experts: Keyword-only: scale each expert's input row by its weight and sum
            the outputs unweighted (needs ``probs``).

    Returns:
        ``[T, dim]`` combined expert outputs, in ``x.dtype``.

    Raises:
        TypeError: Non-floating tensors, integer ``probs``, weights whose dtype differs from
            ``x``'s, or non-integer ``expert_indices``.
        ValueError: Shapes that do not fit together (each message names the expected shape),
            tensors on different devices, ``score_before_experts`` without ``probs``, or (on the
            CPU) an expert index outside ``[0, E)``. On an accelerator an out-of-range index fails
            the device-side assertion of the counting scatter (no host sync checks it).

    Example:
        >>> import torch
        >>> from hp_kernels import mega_moe
        >>> E, D, H = 4, 8, 16
        >>> w1, w3, w2 = torch.randn(E, H, D), torch.randn(E, H, D), torch.randn(E, D, H)
        >>> x, idx = torch.randn(5, D), torch.randint(0, E, (5, 2))
        >>> mega_moe(x, idx, torch.rand(5, 2), w1, w2, w3).shape
        torch.Size([5, 8])

    See Also:
        :pt:`torch._grouped_mm`: the grouped GEMM of the reference kernel;
        :titan:`torchtitan.models.moe.GroupedExperts`: TorchTitan's experts, which run the same
        computation unfused.
    """
    idx, weights = _checked(x, expert_indices, probs, w1, w2, w3, score_before_experts)
    if weights is not None:
        weights = weights.to(x.dtype)
    args = (x, idx, weights, w1, w2, w3, score_before_experts)
    num_experts = w1.shape[0]
    if needs_autograd(x, weights, w1, w2, w3):
        result = run_checked(lambda: _mega_moe_op(*args), idx, num_experts)
    else:
        result = run_checked(lambda: call(_mega_moe_op, [x], *args), idx, num_experts)
    return cast(torch.Tensor, result[0])


def mega_moe_grad(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    score_before_experts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`mega_moe` for ``grad_output``: the fused op's backward, called directly.

    Runs the forward op for the intermediates the backward needs (the gate and up projections,
    the expert outputs, the routing layout) and then ``hp_kernels::mega_moe_grad``, the same op
    autograd calls after :func:`mega_moe`. Not differentiable itself.

    Args:
        grad_output: ``[T, dim]`` gradient of the output of :func:`mega_moe`.
        x: ``[T, dim]`` tokens.
        expert_indices: ``[T, k]`` (or ``[T]``) integer expert of every choice.
        probs: ``[T, k]`` routing weights or ``None``.
        w1: ``[E, hidden, dim]`` gate projections.
        w2: ``[E, dim, hidden]`` down projections.
        w3: ``[E, hidden, dim]`` up projections.
        score_before_experts: Keyword-only, as in :func:`mega_moe`.

    Returns:
        ``(grad_x, grad_probs, grad_w1, grad_w2, grad_w3)``; ``grad_probs`` is ``None`` when
        ``probs`` is, else in ``x.dtype`` with ``probs``' shape.

    Raises:
        TypeError: As :func:`mega_moe`, or ``grad_output`` not in ``x``'s dtype.
        ValueError: As :func:`mega_moe`, or ``grad_output`` not of ``x``'s shape.

    Example:
        >>> import torch
        >>> from hp_kernels import mega_moe_grad
        >>> E, D, H = 3, 8, 16
        >>> w1, w3, w2 = torch.randn(E, H, D), torch.randn(E, H, D), torch.randn(E, D, H)
        >>> x, idx = torch.randn(4, D), torch.randint(0, E, (4, 1))
        >>> g = mega_moe_grad(torch.ones(4, D), x, idx, None, w1, w2, w3)
        >>> [None if t is None else tuple(t.shape) for t in g]
        [(4, 8), None, (3, 16, 8), (3, 8, 16), (3, 16, 8)]

    See Also:
        :pt:`torch.autograd.grad`: the same gradients through autograd.
    """
    idx, weights = _checked(x, expert_indices, probs, w1, w2, w3, score_before_experts)
    if grad_output.shape != x.shape:
        raise ValueError(
            f"grad_output must have x's shape {tuple(x.shape)}, got {tuple(grad_output.shape)}"
        )
    if grad_output.dtype != x.dtype:
        raise TypeError(f"grad_output has dtype {grad_output.dtype}, expected {x.dtype}")
    if weights is not None:
        weights = weights.to(x.dtype)
    num_experts = w1.shape[0]
    with torch.no_grad():
        fwd_args = (x, idx, weights, w1, w2, w3, score_before_experts)
        saved = run_checked(lambda: call(_mega_moe_op, [x], *fwd_args), idx, num_experts)
        _, sorted_indices, counts, gate, up, expert_out = saved
        grads = call(
            _mega_moe_grad_op,
            [x],
            grad_output.contiguous(),
            x,
            idx,
            weights,
            w1,
            w2,
            w3,
            sorted_indices,
            counts,
            gate,
            up,
            expert_out,
            score_before_experts,
        )
    g_x, g_probs, g_w1, g_w2, g_w3 = grads
    if probs is None:
        return g_x, None, g_w1, g_w2, g_w3
    return g_x, g_probs.reshape(probs.shape), g_w1, g_w2, g_w3
