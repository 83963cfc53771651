"""Reduce-scatter copy-in and post-reduce ops for a sharded-gradient runtime (FSDP-style).

Reduce-scatter input layout (exactly PyTorch FSDP2's, i.e. ``torch._chunk_cat`` on dim 0 with
``world_size`` chunks): the flat buffer is ``[world_size, per_rank]``; row ``r`` holds, for each
gradient in order, chunk ``r`` of that gradient flattened. A gradient sharded on dim 0 is padded
with zero rows to ``ceil(d0 / world_size) * world_size`` rows and split in ``world_size`` row
chunks. A gradient sharded on ``dim != 0`` must divide evenly there (as in torch); its chunk
``r`` is ``torch.chunk(grad, world_size, dim)[r]`` in its natural row-major order. A backend's
summation order for an element can depend on where it sits in this buffer, so bit parity with
torch FSDP2 depends on reproducing the layout exactly.

Division (``gradient_divide_factors``): for float32/bfloat16 reductions torch divides once after
the sum (or uses AVG); for other dtypes (float16) it splits the factor ``N`` into a power of two
``pre`` close to ``sqrt(N)`` applied to the input before the sum and ``post = N / pre`` applied
after, to keep the fp16 sum from overflowing or underflowing. Division is true division
(``x / f``), never multiplication by ``1 / f``: the two differ in the last bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch

from hp_kernels._library import call, define_op, needs_autograd

__all__ = [
    "gradient_divide_factors",
    "post_reduce",
    "reduce_scatter_copy_in",
    "reduce_scatter_numel",
]


def _chunk_shape(shape: Sequence[int], dim: int, world_size: int) -> list[int]:
    """Shape of one rank's (padded) chunk of a gradient of ``shape`` sharded on ``dim``."""
    chunk = list(shape)
    chunk[dim] = -(-chunk[dim] // world_size) if dim == 0 else chunk[dim] // world_size
    return chunk


def _arranged(grad: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """A view of ``grad`` whose dim-0 chunks are its ``world_size`` shards on ``dim``.

    Dim 0 is returned as is (``torch._chunk_cat`` pads it). For ``dim != 0`` the shard index is
    moved to the front without a copy: ``[world_size, ..., d / world_size, ...]``, whose chunk
    ``r`` is ``torch.chunk(grad, world_size, dim)[r]`` in its natural order (torch FSDP2 builds
    the same rows with a materialized ``cat(chunk(grad, ws, dim), 0)``).
    """
    if dim == 0:
        return grad
    shape = list(grad.shape)
    split = [*shape[:dim], world_size, shape[dim] // world_size, *shape[dim + 1 :]]
    return grad.reshape(split).movedim(dim, 0)


def _copy_in(
    grads: Sequence[torch.Tensor],
    shard_dims: Sequence[int],
    world_size: int,
    out: torch.Tensor,
    predivide_factor: float | None,
) -> None:
    rows = out.view(world_size, -1)
    offset = 0
    with torch.no_grad():
        # One strided copy (with the cast) per gradient into its column block of the
        # [world_size, per_rank] buffer: measured faster on CPU than torch FSDP2's
        # ``cat(chunk(...))`` + ``torch._chunk_cat`` pair, whose layout it reproduces.
        for grad, dim in zip(grads, shard_dims, strict=True):
            shape = grad.shape
            d = dim % len(shape)
            if d == 0:
                rows_per_chunk = -(-shape[0] // world_size)
                cn = grad.numel() // shape[0] * rows_per_chunk if shape[0] else 0
                if cn:
                    block = rows.narrow(1, offset, cn)
                    _copy_dim0_chunks(grad, world_size, rows_per_chunk, block)
            else:
                cn = grad.numel() // world_size
                if cn:
                    # Even split (checked): the shard index moved to the front, no padding.
                    block = rows.narrow(1, offset, cn)
                    block.view(_arranged_shape(shape, d, world_size)).copy_(
                        _arranged(grad, d, world_size)
                    )
            offset += cn
        _divide(out, predivide_factor)


def _arranged_shape(shape: Sequence[int], dim: int, world_size: int) -> list[int]:
    return [world_size, *shape[:dim], shape[dim] // world_size, *shape[dim + 1 :]]


def _copy_dim0_chunks(
    grad: torch.Tensor, world_size: int, rows_per_chunk: int, block: torch.Tensor
) -> None:
    """Write dim-0 chunk ``r`` of ``grad`` (zero-padded) flattened into row ``r`` of ``block``."""
    cn = block.shape[1]
    flat = grad.reshape(-1)
    full = grad.shape[0] // rows_per_chunk  # chunks with every row present
    block[:full].copy_(flat[: full * cn].view(full, cn))
    if full < world_size:
        tail = flat.numel() - full * cn  # elements of the one partial chunk (may be 0)
        block[full, :tail].copy_(flat[full * cn :])
        block[full, tail:].zero_()
        block[full + 1 :].zero_()


def _exact_reciprocal(divisor: float) -> float | None:
    """``1 / divisor`` when multiplying by it is bitwise equal to dividing (a power of two).

    ``x / 2**k`` and ``x * 2**-k`` are the correctly rounded values of the same real number,
    so they agree in every bit (subnormals included); a multiply is cheaper than a divide.
    """
    mantissa, exponent = math.frexp(divisor)
    if abs(mantissa) == 0.5 and -120 < exponent < 120:
        return 1.0 / divisor
    return None


def _divided(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` as a new tensor (true division, bit for bit)."""
    reciprocal = _exact_reciprocal(divisor)
    return torch.div(t, divisor) if reciprocal is None else torch.mul(t, reciprocal)


def _divide(t: torch.Tensor, divisor: float | None) -> None:
    """``t /= divisor`` in place, in ``t``'s dtype (true division, bit for bit)."""
    if divisor is None or divisor == 1:
        return
    reciprocal = _exact_reciprocal(divisor)
    if reciprocal is None:
        t.div_(divisor)
    else:
        t.mul_(reciprocal)


def _per_rank_numel(shapes: Sequence[Sequence[int]], dims: Sequence[int], world_size: int) -> int:
    total = 0
    for shape, dim in zip(shapes, dims, strict=True):
        d = dim % len(shape)
        total += math.prod(_chunk_shape(shape, d, world_size))
    return total


@define_op("reduce_scatter_copy_in")
def _reduce_scatter_copy_in_op(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    numel = world_size * _per_rank_numel([g.shape for g in grads], shard_dims, world_size)
    out = torch.empty(numel, dtype=dtype, device=grads[0].device)
    _copy_in(grads, shard_dims, world_size, out, predivide_factor)
    return out


@_reduce_scatter_copy_in_op.register_fake
def _(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    numel = world_size * _per_rank_numel([g.shape for g in grads], shard_dims, world_size)
    return grads[0].new_empty(numel, dtype=dtype)


def _rs_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    grads, shard_dims, world_size, _dtype, predivide_factor = inputs
    ctx.shapes = [tuple(g.shape) for g in grads]
    ctx.dtypes = [g.dtype for g in grads]
    ctx.shard_dims = list(shard_dims)
    ctx.world_size = world_size
    ctx.predivide_factor = predivide_factor


def _rs_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    ws = ctx.world_size
    g2d = grad_out.reshape(ws, -1)
    if ctx.predivide_factor is not None and ctx.predivide_factor != 1:
        g2d = g2d / ctx.predivide_factor
    results: list[torch.Tensor] = []
    offset = 0
    for shape, dtype, dim in zip(ctx.shapes, ctx.dtypes, ctx.shard_dims, strict=True):
        d = dim % len(shape)
        chunk = _chunk_shape(shape, d, ws)
        cn = math.prod(chunk)
        blocks = g2d[:, offset : offset + cn].view(ws, *chunk)
        merged = list(chunk)
        merged[d] = chunk[d] * ws
        full = blocks.movedim(0, d).reshape(merged).narrow(d, 0, shape[d])
        results.append(full.to(dtype))
        offset += cn
    return results, None, None, None, None


_reduce_scatter_copy_in_op.register_autograd(_rs_backward, setup_context=_rs_setup_context)


@define_op("reduce_scatter_copy_in_out", mutates_args=("out",))
def _reduce_scatter_copy_in_out_op(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    predivide_factor: float | None,
    out: torch.Tensor,
) -> None:
    _copy_in(grads, shard_dims, world_size, out, predivide_factor)


@_reduce_scatter_copy_in_out_op.register_fake
def _(
    grads: list[torch.Tensor],
    shard_dims: list[int],
    world_size: int,
    predivide_factor: float | None,
    out: torch.Tensor,
) -> None:
    return None


def reduce_scatter_numel(
    shapes: Sequence[Sequence[int]], shard_dims: Sequence[int], world_size: int
) -> int:
    """Number of elements of the reduce-scatter input for gradients of ``shapes``.

    Args:
        shapes: Unsharded gradient shapes.
        shard_dims: Shard dim of each gradient.
        world_size: Number of ranks.

    Returns:
        ``world_size * per_rank_numel``, where a gradient sharded on dim 0 contributes
        ``ceil(d0 / world_size) * prod(rest)`` per rank.

    Raises:
        ValueError: On inconsistent arguments (see :func:`reduce_scatter_copy_in`).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common._get_dim0_padded_size`: PyTorch's
        padded size computation.
    """
    _validate(shapes, shard_dims, world_size)
    return world_size * _per_rank_numel(shapes, shard_dims, world_size)


def _validate(shapes: Sequence[Sequence[int]], shard_dims: Sequence[int], world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if len(shapes) != len(shard_dims):
        raise ValueError(f"got {len(shapes)} gradients but {len(shard_dims)} shard_dims")
    for i, (shape, dim) in enumerate(zip(shapes, shard_dims, strict=True)):
        ndim = len(shape)
        if ndim == 0:
            raise ValueError(f"gradient {i} is 0-d; FSDP shards tensors with at least one dim")
        if not -ndim <= dim < ndim:
            raise ValueError(f"shard_dims[{i}] = {dim} is out of range for shape {tuple(shape)}")
        d = dim % ndim
        if d != 0 and shape[d] % world_size != 0:
            raise ValueError(
                f"gradient {i} of shape {tuple(shape)} is sharded on dim {d} whose size is not "
                f"divisible by world_size {world_size}; like torch FSDP2, Shard(dim != 0) "
                "requires even sharding"
            )


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    shard_dims: Sequence[int],
    world_size: int,
    dtype: torch.dtype,
    *,
    predivide_factor: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack unsharded gradients into one flat reduce-scatter input in PyTorch FSDP2's layout.

    Row ``r`` of the ``[world_size, per_rank]`` result holds, for each gradient in order, its
    chunk ``r`` (padded with zeros on dim 0 to ``ceil(d0 / world_size)`` rows; for a shard dim
    other than 0, ``torch.chunk(grad, world_size, dim)[r]``), flattened and cast to ``dtype``.
    This equals ``torch._chunk_cat`` over the gradients after torch FSDP2's
    ``cat(chunk(grad, ws, dim), 0)`` rearrangement, bit for bit. Only the gradients passed are
    included (pass only parameters that have a gradient). Differentiable (it is linear); the
    ``out=`` variant is not.

    Args:
        grads: Unsharded gradients, all on one device.
        shard_dims: Shard dim of each gradient (negative counts from the end).
        world_size: Number of ranks of the reduce-scatter.
        dtype: Reduce dtype of the buffer (gradients are cast while copying).
        predivide_factor: Keyword-only extension: divide the packed buffer by this factor (true
            division, in ``dtype``, after the cast), as torch does before an fp16 reduction;
            see :func:`gradient_divide_factors`.
        out: Keyword-only extension: preallocated contiguous flat buffer of
            :func:`reduce_scatter_numel` elements of ``dtype`` (e.g. from
            ``ReduceScatter.allocate``).

    Returns:
        The flat buffer of ``world_size * per_rank_numel`` elements (``out`` when given).

    Raises:
        ValueError: If no gradient is given, lengths disagree, a shard dim is out of range, a
            ``dim != 0`` is not divisible by ``world_size``, or ``out`` has the wrong size.
        TypeError: If ``out`` has a dtype other than ``dtype``.

    Example:
        >>> import torch
        >>> from hp_kernels import reduce_scatter_copy_in
        >>> g = torch.arange(3.0)
        >>> reduce_scatter_copy_in([g], [0], 2, torch.float32).tolist()
        [0.0, 1.0, 2.0, 0.0]

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce_scatter_copy_in`:
        PyTorch FSDP2's copy-in (:pt:`torch._chunk_cat`).
    """
    if not grads:
        raise ValueError("reduce_scatter_copy_in needs at least one gradient")
    shapes = [tuple(g.shape) for g in grads]
    dims = [int(d) for d in shard_dims]
    _validate(shapes, dims, world_size)
    devices = {g.device for g in grads}
    if len(devices) != 1:
        raise ValueError(f"all gradients must be on one device, got {sorted(map(str, devices))}")
    pre = None if predivide_factor is None else float(predivide_factor)
    if out is None:
        args = (list(grads), dims, world_size, dtype, pre)
        if needs_autograd(*grads):
            return cast(torch.Tensor, _reduce_scatter_copy_in_op(*args))
        return cast(torch.Tensor, call(_reduce_scatter_copy_in_op, grads, *args))
    numel = world_size * _per_rank_numel(shapes, dims, world_size)
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
    if out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous with {numel} elements, got shape {tuple(out.shape)}"
        )
    call(_reduce_scatter_copy_in_out_op, [out], list(grads), dims, world_size, pre, out)
    return out


def gradient_divide_factors(
    data_parallel_size: int,
    reduce_dtype: torch.dtype,
    factor: float | None = None,
) -> tuple[float | None, float | None]:
    """Split a gradient divide factor into a pre- and post-reduction divisor (SUM reductions).

    For ``float32``/``bfloat16`` nothing is divided before the sum and ``factor`` (default: the
    data-parallel size) after it. For any other reduce dtype (``float16``), as torch FSDP2 does,
    the largest power of two ``pre`` with ``factor % pre == 0`` and ``pre * pre`` not above
    ``factor`` (a power of two near ``sqrt(factor)``) is applied before the reduction and
    ``factor / pre`` after it, so neither the inputs overflow nor the result underflows.

    Args:
        data_parallel_size: Number of ranks whose gradients are summed (shard x replicate).
        reduce_dtype: Dtype the reduction runs in.
        factor: Custom divide factor (``set_gradient_divide_factor``); defaults to
            ``data_parallel_size``.

    Returns:
        ``(predivide_factor, postdivide_factor)``; ``None`` means "do not divide".

    Raises:
        ValueError: If ``data_parallel_size`` is not positive or ``factor`` is not positive.

    Example:
        >>> import torch
        >>> from hp_kernels import gradient_divide_factors
        >>> gradient_divide_factors(8, torch.float16)
        (4, 2.0)
        >>> gradient_divide_factors(3, torch.float32)
        (None, 3.0)

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors`:
        PyTorch FSDP2's split (with ``force_sum_reduction_for_comms=True``).
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}")
    if factor is not None and factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    f = float(data_parallel_size) if factor is None else float(factor)
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, f
    pre = 1
    while f % pre == 0 and f / pre > pre:
        pre *= 2
    return pre, f / pre


@define_op("post_reduce")
def _post_reduce_op(
    reduced: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    y = reduced.clone() if divide_factor is None else _divided(reduced, divide_factor)
    if scale is not None:
        y = y.mul_(scale)
    if out_dtype is not None and out_dtype != y.dtype:
        y = y.to(out_dtype)
    return y


@_post_reduce_op.register_fake
def _(
    reduced: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    return torch.empty_like(reduced, dtype=out_dtype or reduced.dtype)


def _pr_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    reduced, divide_factor, scale, _out_dtype = inputs
    ctx.in_dtype = reduced.dtype
    ctx.divide_factor = divide_factor
    ctx.scale = scale


def _pr_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    g = grad.to(ctx.in_dtype)
    if ctx.divide_factor is not None:
        g = g / ctx.divide_factor
    if ctx.scale is not None:
        g = g * ctx.scale
    return g, None, None, None


_post_reduce_op.register_autograd(_pr_backward, setup_context=_pr_setup_context)


@define_op("post_reduce_accumulate", mutates_args=("accumulate_into",))
def _post_reduce_accumulate_op(
    reduced: torch.Tensor,
    accumulate_into: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> None:
    with torch.no_grad():
        y = reduced if divide_factor is None else _divided(reduced, divide_factor)
        if scale is not None:
            y = y * scale
        if out_dtype is not None and out_dtype != y.dtype:
            y = y.to(out_dtype)
        accumulate_into.view(-1).add_(y.view(-1))


@_post_reduce_accumulate_op.register_fake
def _(
    reduced: torch.Tensor,
    accumulate_into: torch.Tensor,
    divide_factor: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> None:
    return None


@define_op("post_reduce_inplace", mutates_args=("reduced",))
def _post_reduce_inplace_op(
    reduced: torch.Tensor, divide_factor: float | None, scale: float | None
) -> None:
    # No grad-mode switch: post_reduce rejects inputs that require grad before calling this,
    # and the dispatcher runs it below autograd (a no_grad block cost more than the division).
    _divide(reduced, divide_factor)
    if scale is not None:
        reduced.mul_(scale)


@_post_reduce_inplace_op.register_fake
def _(reduced: torch.Tensor, divide_factor: float | None, scale: float | None) -> None:
    return None


def post_reduce(
    reduced_shard: torch.Tensor,
    *,
    divide_factor: float | None = None,
    scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate_into: torch.Tensor | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Finish a reduced gradient shard: divide, scale, cast, and optionally accumulate.

    Computes ``y = reduced_shard / divide_factor`` (true division, in the reduce dtype), then
    ``y = y * scale``, then ``y = y.to(out_dtype)``; with ``accumulate_into`` it then does
    ``accumulate_into += y`` in place (the existing sharded gradient, or an fp32 main gradient
    while ``y`` stays in the reduce dtype). This is the order torch FSDP2 uses (divide in the
    reduce dtype, cast to the parameter dtype, accumulate), so results are bitwise equal to it.
    For fp16 use :func:`gradient_divide_factors` to get the post-divide part of torch's split.

    Args:
        reduced_shard: Output of the reduce-scatter (flat or any shape).
        divide_factor: Divide by this (``None``: no division).
        scale: Multiply by this after dividing (``None``: no scaling), e.g. a gradient scaling
            factor.
        out_dtype: Cast to this dtype (``None``: keep the reduce dtype).
        accumulate_into: Tensor with the same number of elements to add the result into, in
            place (contiguous).
        inplace: Keyword-only extension: divide/scale ``reduced_shard`` itself (no new buffer);
            only when ``out_dtype`` is ``None`` or equal to its dtype and ``accumulate_into`` is
            ``None``.

    Returns:
        ``accumulate_into`` when given, ``reduced_shard`` when ``inplace``, else a new tensor.
        Differentiable in the plain form.

    Raises:
        ValueError: On a zero ``divide_factor``, a size mismatch, or ``inplace`` combined with a
            cast, an accumulation, or an input that requires grad.

    Example:
        >>> import torch
        >>> from hp_kernels import post_reduce
        >>> post_reduce(torch.tensor([3.0, 6.0]), divide_factor=3.0).tolist()
        [1.0, 2.0]

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce`: PyTorch FSDP2's
        post-reduce division, cast and ``grad += new_sharded_grad`` accumulation.
    """
    div = None if divide_factor is None else float(divide_factor)
    if div == 0.0:
        raise ValueError("divide_factor must be non-zero")
    sc = None if scale is None else float(scale)
    if inplace:
        if accumulate_into is not None or (
            out_dtype is not None and out_dtype != reduced_shard.dtype
        ):
            raise ValueError(
                "inplace=True needs out_dtype None (or the input dtype) and no accumulate_into"
            )
        if needs_autograd(reduced_shard) and not torch.compiler.is_compiling():
            raise ValueError("inplace=True is not differentiable; got a tensor that requires grad")
        call(_post_reduce_inplace_op, [reduced_shard], reduced_shard, div, sc)
        return reduced_shard
    if accumulate_into is None:
        if needs_autograd(reduced_shard):
            return cast(torch.Tensor, _post_reduce_op(reduced_shard, div, sc, out_dtype))
        result = call(_post_reduce_op, [reduced_shard], reduced_shard, div, sc, out_dtype)
        return cast(torch.Tensor, result)
    if accumulate_into.numel() != reduced_shard.numel() or not accumulate_into.is_contiguous():
        raise ValueError(
            f"accumulate_into must be contiguous with {reduced_shard.numel()} elements, got "
            f"shape {tuple(accumulate_into.shape)}"
        )
    args = (reduced_shard.contiguous(), accumulate_into, div, sc, out_dtype)
    call(_post_reduce_accumulate_op, [accumulate_into], *args)
    return accumulate_into
