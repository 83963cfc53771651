# Triton's DSL kernels and decorators are untyped, and CI type-checks without triton installed:
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-not-found,import-untyped"
"""Shared Triton pieces: exact dtype conversions, autotune configs, argument tables.

Imported only when a Triton kernel runs (it imports ``triton``).

Conversions are written with integer bit operations rather than ``.to(tl.bfloat16)``: the
result is the same as the hardware's round-to-nearest-even conversion on a GPU, and it is also
exact under ``TRITON_INTERPRET=1``, whose numpy emulation of bfloat16 casts truncates instead of
rounding (so interpreter runs can check bit parity with torch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__: list[str] = []

#: Whether kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Dtypes the Triton kernels compute with (others run the reference kernel).
TRITON_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def supported(*dtypes: torch.dtype) -> bool:
    """Whether every dtype is one the kernels handle."""
    return all(d in TRITON_DTYPES for d in dtypes)


def block_configs(blocks: Sequence[int], interpreted_block: int = 512) -> list[triton.Config]:
    """Autotune configs over ``BLOCK`` (one small config in the interpreter: no benchmarking)."""
    if INTERPRETING:
        return [triton.Config({"BLOCK": interpreted_block}, num_warps=1)]
    return [triton.Config({"BLOCK": b}, num_warps=4 if b <= 1024 else 8) for b in blocks]


def device_divides_by_reciprocal(t: torch.Tensor) -> bool:
    """Whether torch divides by a Python scalar as ``x * (1 / s)`` on ``t``'s device.

    PyTorch's GPU kernel for ``tensor / scalar`` multiplies by the reciprocal computed in the
    op-math dtype; its CPU kernel divides. The Triton kernels follow the device they run on
    (CPU tensors only reach them under the interpreter), so they match torch there bit for bit.
    """
    return not t.is_cpu


def fp32_reciprocal(value: float) -> float:
    """``1 / value`` rounded to float32, as torch's GPU division computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32))


def table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """An int64 ``[len(rows), len(rows[0])]`` argument table on ``device``."""
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


@triton.jit
def to_f32(x):
    """Exact widening of a float16/bfloat16/float32 block to float32."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def from_f32(y, DST: tl.constexpr):
    """float32 to ``DST`` with round-to-nearest-even (bfloat16 NaN -> 0x7FC0, as torch)."""
    if DST == tl.bfloat16:  # noqa: SIM300 (DST is a compile-time dtype, not a constant)
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(y != y, 0x7FC0, rounded).to(tl.uint16)
        z = half.to(tl.bfloat16, bitcast=True)
    else:
        z = y.to(DST)
    return z


@triton.jit
def cast(x, DST: tl.constexpr):
    """Exact conversion between float16, bfloat16 and float32 (through float32)."""
    if x.dtype == DST:  # noqa: SIM108 (Triton resolves this branch at compile time)
        z = x
    else:
        z = from_f32(to_f32(x), DST)
    return z


@triton.jit
def divide(y, divisor, RECIPROCAL: tl.constexpr):
    """``y / divisor`` in float32: true division, or times the reciprocal ``divisor`` holds."""
    if RECIPROCAL:  # noqa: SIM108 (Triton resolves this branch at compile time)
        z = y * divisor
    else:
        z = tl.math.div_rn(y, divisor)
    return z
