# Triton's DSL kernels and decorators are untyped, and CI type-checks without triton installed:
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-not-found,import-untyped"
"""Triton kernel of the log-sum-exp merge of attention partials (ring attention).

One program merges a block of rows: ``lse = logaddexp(lse_a, lse_b)`` and
``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b`` in float32, with a row empty on
both sides (``lse = -inf``) giving a zero output. ``exp``/``log`` come from the device's math
library, so the result matches the reference to float32 rounding of those functions (tested
with rtol 1e-5 / atol 1e-6 in float32 and one ulp of bfloat16/float16), not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hp_kernels._library import REFERENCE_KERNELS
from hp_kernels.triton_kernels._common import INTERPRETING, cast, supported, to_f32

__all__: list[str] = []


def _configs() -> list[triton.Config]:
    rows = (4,) if INTERPRETING else (1, 4, 16)
    return [triton.Config({"BLOCK_ROWS": r}, num_warps=4) for r in rows]


@triton.autotune(configs=_configs(), key=["num_rows", "BLOCK_D"])
@triton.jit
def _merge_kernel(
    out_a,
    lse_a,
    out_b,
    lse_b,
    out,
    lse,
    num_rows,
    width,
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = r < num_rows
    la = to_f32(tl.load(lse_a + r, mask=row_mask, other=0.0))
    lb = to_f32(tl.load(lse_b + r, mask=row_mask, other=0.0))
    high = tl.maximum(la, lb)
    empty = high == float("-inf")
    safe_high = tl.where(empty, 0.0, high)
    total = tl.exp(la - safe_high) + tl.exp(lb - safe_high)
    merged = safe_high + tl.log(tl.where(empty, 1.0, total))
    merged = tl.where(empty, float("-inf"), merged)
    pivot = tl.where(empty, 0.0, merged)
    ca = tl.exp(la - pivot)
    cb = tl.exp(lb - pivot)
    c = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (c[None, :] < width)
    at = r[:, None] * width + c[None, :]
    oa = to_f32(tl.load(out_a + at, mask=mask, other=0.0))
    ob = to_f32(tl.load(out_b + at, mask=mask, other=0.0))
    o = oa * ca[:, None] + ob * cb[:, None]
    tl.store(out + at, cast(o, out.dtype.element_ty), mask=mask)
    tl.store(lse + r, cast(merged, lse.dtype.element_ty), mask=row_mask)


def merge_attention_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of ``hp_kernels::merge_attention_partials`` (same result)."""
    width = out_a.shape[-1] if out_a.dim() else 1
    if not supported(out_a.dtype, lse_a.dtype) or width > 4096:
        result: tuple[torch.Tensor, torch.Tensor] = REFERENCE_KERNELS["merge_attention_partials"](
            out_a, lse_a, out_b, lse_b
        )
        return result
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_a, memory_format=torch.contiguous_format)
    num_rows = lse_a.numel()
    if num_rows and width:

        def grid(cfg: dict[str, int]) -> tuple[int]:
            return (triton.cdiv(num_rows, cfg["BLOCK_ROWS"]),)

        _merge_kernel[grid](
            out_a.contiguous(),
            lse_a.contiguous(),
            out_b.contiguous(),
            lse_b.contiguous(),
            out,
            lse,
            num_rows,
            width,
            BLOCK_D=triton.next_power_of_2(width),
        )
    return out, lse


def launchers() -> dict[str, object]:
    """The launcher of every op this module implements, by op name."""
    return {"merge_attention_partials": merge_attention_partials}
