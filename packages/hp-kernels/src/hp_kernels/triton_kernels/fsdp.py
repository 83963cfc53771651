# Triton's DSL kernels and decorators are untyped, and CI type-checks without triton installed:
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-not-found,import-untyped"
"""Triton kernels of the FSDP communication path, and their launchers.

Each launcher has the signature of the ``hp_kernels`` op it implements and is what the CUDA
registration calls; tests call it directly on CPU tensors under ``TRITON_INTERPRET=1``. A call
with a dtype the kernels do not handle (anything but float32/bfloat16/float16) runs the
reference kernel instead. Multi-tensor kernels read a per-tensor argument table (data pointer,
sizes, offsets), so each is one launch per source dtype (one launch in the usual single-dtype
case) whatever the number of tensors.

- ``all_gather_copy_in``: cast + pack every shard (zero-padding short ones) in one launch.
- ``all_gather_copy_out``: unpack every rank's slice into every parameter's rank-major
  storage in one launch (the layout :func:`hp_kernels.unpadded_views` reads for ``Shard(0)``,
  uneven ``Shard(0)`` and ``Shard(1)`` alike).
- ``reduce_scatter_copy_in``: PyTorch FSDP2's chunk-cat layout, padding, cast and pre-division.
- ``post_reduce`` (+ in place, + accumulate): divide, scale, cast, accumulate, in one pass.

Arithmetic is torch's, step by step (rounding to the reduce dtype after the division and after
the scale, then to the output dtype, then the accumulation in float32), so results are bitwise
equal to the reference on the same device (see ``device_divides_by_reciprocal``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hp_kernels._library import REFERENCE_KERNELS
from hp_kernels.triton_kernels._common import (
    TRITON_DTYPES,
    block_configs,
    cast,
    device_divides_by_reciprocal,
    divide,
    fp32_reciprocal,
    from_f32,
    supported,
    table,
    to_f32,
)

__all__: list[str] = []

_COPY_BLOCKS = (256, 1024, 4096)


@triton.autotune(configs=block_configs(_COPY_BLOCKS), key=["max_split", "ntensors"])
@triton.jit
def _all_gather_copy_in_kernel(
    meta,  # [n, 4]: src pointer, src numel, split, offset in the rank's slice
    dst,
    max_split,
    ntensors,
    SRC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(1)
    src = tl.load(meta + i * 4).to(tl.pointer_type(SRC))
    numel = tl.load(meta + i * 4 + 1)
    split = tl.load(meta + i * 4 + 2)
    offset = tl.load(meta + i * 4 + 3)
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + k, mask=k < numel, other=0.0)
    tl.store(dst + offset + k, cast(x, dst.dtype.element_ty), mask=k < split)


def all_gather_copy_in(
    shards: list[torch.Tensor],
    input_split_sizes: list[int],
    rank: int,
    all_gather_output: torch.Tensor,
) -> None:
    """Triton launcher of ``hp_kernels::all_gather_copy_in`` (same signature and result)."""
    dtypes = {s.dtype for s in shards}
    if not supported(all_gather_output.dtype, *dtypes):
        REFERENCE_KERNELS["all_gather_copy_in"](shards, input_split_sizes, rank, all_gather_output)
        return
    total = sum(input_split_sizes)
    base = rank * total
    offsets = [base + sum(input_split_sizes[:i]) for i in range(len(shards))]
    for dtype in dtypes:
        members = [i for i, s in enumerate(shards) if s.dtype == dtype]
        flats = [shards[i].contiguous().view(-1) for i in members]  # kept alive for the launch
        rows = [
            [f.data_ptr(), f.numel(), input_split_sizes[i], offsets[i]]
            for i, f in zip(members, flats, strict=True)
        ]
        max_split = max(input_split_sizes[i] for i in members)
        if max_split == 0:
            continue
        meta = table(rows, all_gather_output.device)

        def grid(cfg: dict[str, int], n: int = len(rows), m: int = max_split) -> tuple[int, int]:
            return (triton.cdiv(m, cfg["BLOCK"]), n)

        _all_gather_copy_in_kernel[grid](
            meta, all_gather_output, max_split, len(rows), SRC=TRITON_DTYPES[dtype]
        )


@triton.autotune(configs=block_configs(_COPY_BLOCKS), key=["max_split", "ntensors"])
@triton.jit
def _all_gather_copy_out_kernel(
    meta,  # [n, 3]: out pointer, split, offset in a rank's slice
    src,
    total,
    max_split,
    ntensors,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(2)
    r = tl.program_id(1).to(tl.int64)
    out = tl.load(meta + i * 3).to(tl.pointer_type(src.dtype.element_ty))
    split = tl.load(meta + i * 3 + 1)
    offset = tl.load(meta + i * 3 + 2)
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = k < split
    x = tl.load(src + r * total + offset + k, mask=mask)
    tl.store(out + r * split + k, x, mask=mask)


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    input_split_sizes: list[int],
    world_size: int,
    out: list[torch.Tensor],
) -> None:
    """Triton launcher of ``hp_kernels::all_gather_copy_out`` (same signature and result)."""
    if not supported(all_gather_output.dtype) or not out:
        REFERENCE_KERNELS["all_gather_copy_out"](
            all_gather_output, input_split_sizes, world_size, out
        )
        return
    total = sum(input_split_sizes)
    offsets = [sum(input_split_sizes[:i]) for i in range(len(out))]
    rows = [
        [o.data_ptr(), s, off] for o, s, off in zip(out, input_split_sizes, offsets, strict=True)
    ]
    max_split = max(input_split_sizes)
    if max_split == 0:
        return
    meta = table(rows, all_gather_output.device)

    def grid(cfg: dict[str, int]) -> tuple[int, int, int]:
        return (triton.cdiv(max_split, cfg["BLOCK"]), world_size, len(rows))

    _all_gather_copy_out_kernel[grid](meta, all_gather_output, total, max_split, len(rows))


@triton.autotune(configs=block_configs(_COPY_BLOCKS), key=["max_chunk", "ntensors"])
@triton.jit
def _reduce_scatter_copy_in_kernel(
    meta,  # [n, 6]: src pointer, outer, dim size, inner, chunk rows, column offset
    dst,
    per_rank,
    predivisor,
    max_chunk,
    ntensors,
    SRC: tl.constexpr,
    PREDIVIDE: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(2)
    r = tl.program_id(1).to(tl.int64)
    src = tl.load(meta + i * 6).to(tl.pointer_type(SRC))
    outer = tl.load(meta + i * 6 + 1)
    size = tl.load(meta + i * 6 + 2)
    inner = tl.load(meta + i * 6 + 3)
    rows = tl.load(meta + i * 6 + 4)
    offset = tl.load(meta + i * 6 + 5)
    chunk = outer * rows * inner
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = k // (rows * inner)
    row = r * rows + (k // inner) % rows  # row of the shard dim in the unsharded gradient
    present = (k < chunk) & (row < size)  # rows past the dim-0 size are the zero padding
    x = tl.load(src + (a * size + row) * inner + k % inner, mask=present, other=0.0)
    DST: tl.constexpr = dst.dtype.element_ty
    y = cast(x, DST)
    if PREDIVIDE:
        y = from_f32(divide(to_f32(y), predivisor, RECIPROCAL), DST)
    tl.store(dst + r * per_rank + offset + k, y, mask=k < chunk)


def reduce_scatter_copy_in_out(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    predivide_factor: float | None,
    out: torch.Tensor,
) -> None:
    """Triton launcher of ``hp_kernels::reduce_scatter_copy_in_out`` (same result)."""
    dtypes = {g.dtype for g in grads}
    if not supported(out.dtype, *dtypes):
        REFERENCE_KERNELS["reduce_scatter_copy_in_out"](
            grads, shard_dims, world_size, predivide_factor, out
        )
        return
    entries: list[tuple[torch.Tensor, list[int]]] = []
    offset = 0
    for g, dim in zip(grads, shard_dims, strict=True):
        d = dim % g.dim()
        shape = list(g.shape)
        size = shape[d]
        rows = -(-size // world_size) if d == 0 else size // world_size
        outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1 :])
        chunk = outer * rows * inner
        if chunk:  # an empty chunk writes nothing (and would divide by zero in the kernel)
            flat = g.contiguous()
            entries.append((flat, [flat.data_ptr(), outer, size, inner, rows, offset]))
        offset += chunk
    per_rank = offset
    predivide = predivide_factor is not None and predivide_factor != 1
    reciprocal = predivide and device_divides_by_reciprocal(out)
    predivisor = 1.0
    if predivide:
        assert predivide_factor is not None
        predivisor = fp32_reciprocal(predivide_factor) if reciprocal else float(predivide_factor)
    for dtype in dtypes:
        group = [(t, row) for t, row in entries if t.dtype == dtype]
        if not group:
            continue
        max_chunk = max(row[1] * row[4] * row[3] for _, row in group)
        meta = table([row for _, row in group], out.device)

        def grid(cfg: dict[str, int], n: int = len(group), m: int = max_chunk) -> tuple[int, ...]:
            return (triton.cdiv(m, cfg["BLOCK"]), world_size, n)

        _reduce_scatter_copy_in_kernel[grid](
            meta,
            out,
            per_rank,
            predivisor,
            max_chunk,
            len(group),
            SRC=TRITON_DTYPES[dtype],
            PREDIVIDE=predivide,
            RECIPROCAL=reciprocal,
        )


def reduce_scatter_copy_in(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    """Triton launcher of ``hp_kernels::reduce_scatter_copy_in`` (same result)."""
    from hp_kernels.reduce_scatter import reduce_scatter_numel

    numel = reduce_scatter_numel([g.shape for g in grads], shard_dims, world_size)
    out = torch.empty(numel, dtype=dtype, device=grads[0].device)
    reduce_scatter_copy_in_out(grads, shard_dims, world_size, predivide_factor, out)
    return out


@triton.autotune(configs=block_configs((1024, 4096)), key=["numel"], restore_value=["acc"])
@triton.jit
def _post_reduce_kernel(
    src,
    dst,
    acc,
    numel,
    divisor,
    scale,
    DIVIDE: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = k < numel
    x = tl.load(src + k, mask=mask)
    REDUCE: tl.constexpr = src.dtype.element_ty
    y = x
    if DIVIDE:  # rounded to the reduce dtype after each step, as torch's separate ops do
        y = from_f32(divide(to_f32(y), divisor, RECIPROCAL), REDUCE)
    if SCALE:
        y = from_f32(to_f32(y) * scale, REDUCE)
    if ACCUMULATE:
        y = cast(y, dst.dtype.element_ty)  # the output dtype, then added in float32
        total = to_f32(tl.load(acc + k, mask=mask)) + to_f32(y)
        tl.store(acc + k, from_f32(total, acc.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + k, cast(y, dst.dtype.element_ty), mask=mask)


def _post_reduce_launch(
    reduced: torch.Tensor,
    dst: torch.Tensor,
    acc: torch.Tensor | None,
    divide_factor: float | None,
    scale: float | None,
) -> None:
    src = reduced.contiguous()
    numel = src.numel()
    if numel == 0:
        return
    reciprocal = divide_factor is not None and device_divides_by_reciprocal(src)
    divisor = 1.0
    if divide_factor is not None:
        divisor = fp32_reciprocal(divide_factor) if reciprocal else float(divide_factor)
    accumulate = acc is not None

    def grid(cfg: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(numel, cfg["BLOCK"]),)

    _post_reduce_kernel[grid](
        src,
        dst,
        acc if acc is not None else dst,
        numel,
        divisor,
        1.0 if scale is None else float(scale),
        DIVIDE=divide_factor is not None,
        RECIPROCAL=reciprocal,
        SCALE=scale is not None,
        ACCUMULATE=accumulate,
    )


def post_reduce(
    reduced: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Triton launcher of ``hp_kernels::post_reduce`` (same signature and result)."""
    dtype = out_dtype or reduced.dtype
    if not supported(reduced.dtype, dtype):
        result: torch.Tensor = REFERENCE_KERNELS["post_reduce"](
            reduced, divide_factor, scale, out_dtype
        )
        return result
    out = torch.empty(reduced.shape, dtype=dtype, device=reduced.device)
    _post_reduce_launch(reduced, out, None, divide_factor, scale)
    return out


def post_reduce_inplace(
    reduced: torch.Tensor, divide_factor: float | None, scale: float | None
) -> None:
    """Triton launcher of ``hp_kernels::post_reduce_inplace`` (same signature and result)."""
    if not supported(reduced.dtype) or not reduced.is_contiguous():
        REFERENCE_KERNELS["post_reduce_inplace"](reduced, divide_factor, scale)
        return
    _post_reduce_launch(reduced, reduced, None, divide_factor, scale)


def post_reduce_accumulate(
    reduced: torch.Tensor,
    accumulate_into: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> None:
    """Triton launcher of ``hp_kernels::post_reduce_accumulate`` (same result)."""
    dtype = out_dtype or reduced.dtype
    if not supported(reduced.dtype, dtype, accumulate_into.dtype) or not (
        accumulate_into.is_contiguous()
    ):
        REFERENCE_KERNELS["post_reduce_accumulate"](
            reduced, accumulate_into, divide_factor, scale, out_dtype
        )
        return
    # ``dst`` only carries the output dtype here (nothing is stored through it).
    carrier = torch.empty(1, dtype=dtype, device=reduced.device)
    _post_reduce_launch(reduced, carrier, accumulate_into, divide_factor, scale)


def launchers() -> dict[str, object]:
    """The launcher of every op this module implements, by op name."""
    return {
        "all_gather_copy_in": all_gather_copy_in,
        "all_gather_copy_out": all_gather_copy_out,
        "reduce_scatter_copy_in": reduce_scatter_copy_in,
        "reduce_scatter_copy_in_out": reduce_scatter_copy_in_out,
        "post_reduce": post_reduce,
        "post_reduce_inplace": post_reduce_inplace,
        "post_reduce_accumulate": post_reduce_accumulate,
    }
