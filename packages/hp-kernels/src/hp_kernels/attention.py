"""Log-sum-exp merge of partial attention outputs (ring / blockwise attention).

Two attention passes over disjoint key blocks give outputs ``o_a, o_b`` and log-sum-exps
``l_a, l_b`` (natural log of the softmax denominators). The attention over the union is
``l = log(exp(l_a) + exp(l_b))`` and ``o = exp(l_a - l) * o_a + exp(l_b - l) * o_b``. The merge
is computed in float32 (or float64 for float64 inputs) in a numerically stable form, and a row
that saw no key on either side (``l_a = l_b = -inf``) gives ``o = 0`` and ``l = -inf``.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from hp_kernels._library import call, define_op, needs_autograd

__all__ = ["merge_attention_partials"]


#: Dtypes the merge computes in (a pair in one of them needs no cast).
_NATIVE_COMPUTE = (torch.float32, torch.float64)


def _compute_dtype(out: torch.Tensor, lse: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Return ``(c_a, c_b, lse)`` with ``c_x = exp(lse_x - lse)``, 0 for rows with no key."""
    lse = torch.logaddexp(lse_a, lse_b)
    # A row empty on both sides has lse = -inf; subtracting 0 there instead keeps its weights
    # exp(-inf) = 0 (rather than exp(-inf - -inf) = NaN), in one small pass. (A NaN lse, from
    # NaN inputs, becomes 0 here but its weights stay NaN through lse_x.)
    safe = torch.nan_to_num(lse, neginf=0.0)
    return torch.sub(lse_a, safe).exp_(), torch.sub(lse_b, safe).exp_(), lse


@define_op("merge_attention_partials")
def _merge_op(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if out_a.dtype == lse_a.dtype and out_a.dtype in _NATIVE_COMPUTE:
        # Already in the compute dtype: skip six no-op ``.to`` calls (about 1 us each).
        c_a, c_b, lse = _weights(lse_a, lse_b)
        out = torch.mul(out_a, c_a.unsqueeze(-1))
        return out.addcmul_(out_b, c_b.unsqueeze(-1)), lse
    compute = _compute_dtype(out_a, lse_a)
    c_a, c_b, lse = _weights(lse_a.to(compute), lse_b.to(compute))
    out = torch.mul(out_a.to(compute), c_a.unsqueeze(-1))
    out.addcmul_(out_b.to(compute), c_b.unsqueeze(-1))
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


@_merge_op.register_fake
def _(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(out_a), torch.empty_like(lse_a)


def _merge_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    out_a, lse_a, out_b, lse_b = inputs
    out, _ = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out)


def _merge_backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> Any:
    out_a, lse_a, out_b, lse_b, out = ctx.saved_tensors
    compute = _compute_dtype(out_a, lse_a)
    ca, cb, _ = _weights(lse_a.to(compute), lse_b.to(compute))
    go = torch.zeros_like(out, dtype=compute) if g_out is None else g_out.to(compute)
    gl = torch.zeros_like(ca) if g_lse is None else g_lse.to(compute)
    o = out.to(compute)
    # out = c_a o_a + c_b o_b with c_x = exp(lse_x - lse):
    # d out / d lse_a = c_a (o_a - out) and d lse / d lse_a = c_a (likewise for b).
    g_lse_a = ca * (gl + (go * (out_a.to(compute) - o)).sum(-1))
    g_lse_b = cb * (gl + (go * (out_b.to(compute) - o)).sum(-1))
    g_out_a = ca.unsqueeze(-1) * go
    g_out_b = cb.unsqueeze(-1) * go
    return (
        g_out_a.to(out_a.dtype),
        g_lse_a.to(lse_a.dtype),
        g_out_b.to(out_b.dtype),
        g_lse_b.to(lse_b.dtype),
    )


_merge_op.register_autograd(_merge_backward, setup_context=_merge_setup)


def merge_attention_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets by log-sum-exp.

    Computes ``lse = logaddexp(lse_a, lse_b)`` and
    ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b`` in float32 (float64 for
    float64 inputs). A side that saw no key must carry ``lse = -inf`` and a finite output; a
    row with no key on either side gives ``lse = -inf`` and a zero output.

    Args:
        out_a: Partial output ``[..., D]`` (e.g. ``[B, H, S, D]``).
        lse_a: Its log-sum-exp, shape ``out_a.shape[:-1]`` (e.g. ``[B, H, S]``).
        out_b: The other partial output, same shape and dtype as ``out_a``.
        lse_b: Its log-sum-exp, same shape and dtype as ``lse_a``.

    Returns:
        ``(out, lse)`` of the merged attention, in the dtypes of ``out_a`` and ``lse_a``.
        Differentiable in all four inputs.

    Raises:
        ValueError: If shapes disagree.
        TypeError: If dtypes of the pairs disagree.

    Example:
        >>> import torch
        >>> from hp_kernels import merge_attention_partials
        >>> o, l = merge_attention_partials(
        ...     torch.ones(1, 2), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1)
        ... )
        >>> o.tolist(), round(l.item(), 4)
        ([[0.5, 0.5]], 0.6931)

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's ring attention,
        which merges per-step partial outputs by their log-sum-exp.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"partials disagree in shape: out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if out_a.dim() < 1 or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            f"lse must have shape out.shape[:-1] = {tuple(out_a.shape[:-1])}, "
            f"got {tuple(lse_a.shape)}"
        )
    if out_a.dtype != out_b.dtype or lse_a.dtype != lse_b.dtype:
        raise TypeError(
            f"partials disagree in dtype: out {out_a.dtype} vs {out_b.dtype}, "
            f"lse {lse_a.dtype} vs {lse_b.dtype}"
        )
    if needs_autograd(out_a, lse_a, out_b, lse_b):
        result = _merge_op(out_a, lse_a, out_b, lse_b)
    else:
        result = call(_merge_op, [out_a], out_a, lse_a, out_b, lse_b)
    return cast(tuple[torch.Tensor, torch.Tensor], result)
