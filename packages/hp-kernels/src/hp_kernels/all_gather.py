"""All-gather copy-in / copy-out ops for a sharded-parameter runtime (FSDP-style unshard).

Layout (the one PyTorch FSDP2 uses): each rank packs its local shards, flattened and cast to one
communication dtype, into a contiguous slice of ``total = sum(input_split_sizes)`` elements; the
all-gather output is ``world_size`` such slices back to back (rank-major). Copy-out splits every
rank's slice by the same split sizes, producing for parameter ``i`` a tensor of
``world_size * input_split_sizes[i]`` elements whose rank ``r`` block is rank ``r``'s shard ``i``.
:func:`unpadded_views` then turns such a tensor into the unsharded parameter.

The ops are ``torch.library`` custom ops (``torch.ops.hp_kernels.all_gather_copy_in`` and
``torch.ops.hp_kernels.all_gather_copy_out``) that write into caller-provided buffers. Custom ops
cannot return views of their inputs, so the slicing (``narrow``/``view``) happens in the Python
wrappers below. They are communication-buffer packers and are not differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hp_kernels._library import call, define_op
from hp_kernels._torch_compat import foreach_copy_, set_grad_enabled

__all__ = ["all_gather_copy_in", "all_gather_copy_out", "unpadded_views"]


@define_op("all_gather_copy_in", mutates_args=("all_gather_output",))
def _all_gather_copy_in_op(
    shards: list[torch.Tensor],
    input_split_sizes: list[int],
    rank: int,
    all_gather_output: torch.Tensor,
) -> None:
    total = sum(input_split_sizes)
    all_gather_input = all_gather_output.narrow(0, rank * total, total)
    dsts = all_gather_input.split_with_sizes(list(input_split_sizes))
    full_dsts: list[torch.Tensor] = []
    full_srcs: list[torch.Tensor] = []
    with torch.no_grad():
        for dst, shard in zip(dsts, shards, strict=True):
            n = shard.numel()
            flat = shard.reshape(-1)
            if n == dst.numel():
                full_dsts.append(dst)
                full_srcs.append(flat)
            else:
                dst[:n].copy_(flat)
                dst[n:].zero_()
        if full_dsts:
            foreach_copy_(full_dsts, full_srcs)


@_all_gather_copy_in_op.register_fake
def _(
    shards: list[torch.Tensor],
    input_split_sizes: list[int],
    rank: int,
    all_gather_output: torch.Tensor,
) -> None:
    return None


@define_op("all_gather_copy_out", mutates_args=("out",))
def _all_gather_copy_out_op(
    all_gather_output: torch.Tensor,
    input_split_sizes: list[int],
    world_size: int,
    out: list[torch.Tensor],
) -> None:
    # Grad mode off around the out= copy (outputs may be storage of parameters that require
    # grad), switched directly: the ``no_grad`` context object costs more than the switch.
    grad_mode = torch.is_grad_enabled()
    set_grad_enabled(False)
    try:
        torch.split_with_sizes_copy(
            all_gather_output.view(world_size, -1),
            input_split_sizes,
            dim=1,
            out=[o.view(world_size, -1) for o in out],
        )
    finally:
        set_grad_enabled(grad_mode)


@_all_gather_copy_out_op.register_fake
def _(
    all_gather_output: torch.Tensor,
    input_split_sizes: list[int],
    world_size: int,
    out: list[torch.Tensor],
) -> None:
    return None


def _check_world(world_size: int, rank: int | None = None) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


def all_gather_copy_in(
    shards: Sequence[torch.Tensor],
    input_split_sizes: Sequence[int],
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack this rank's shards into its slice of a flat all-gather buffer.

    Every shard is flattened, cast to ``dtype`` and written to its own segment of
    ``input_split_sizes[i]`` elements, in order; a shard with fewer elements than its split (an
    unpadded last shard) is zero-padded to the split size. One op call replaces the per-parameter
    Python loop of copies.

    Args:
        shards: The local shards, any shapes and floating dtypes, all on one device.
        input_split_sizes: Elements reserved for each shard in the buffer (its padded numel).
        world_size: Number of ranks taking part in the all-gather.
        rank: This rank's index in the all-gather group.
        dtype: Communication dtype of the buffer (shards are cast to it).
        device: Device of the buffer; defaults to the first shard's device.
        out: Keyword-only extension: a preallocated flat buffer of
            ``world_size * sum(input_split_sizes)`` elements of ``dtype`` (e.g. from
            ``AllGather.allocate``) to pack into instead of a new one.

    Returns:
        ``(all_gather_input, all_gather_output)``: the output is the flat 1-D buffer of
        ``world_size * sum(input_split_sizes)`` elements; the input is its view
        ``all_gather_output.narrow(0, rank * total, total)`` holding the packed shards. The
        other ranks' slices are left uninitialized (the all-gather overwrites them).

    Raises:
        ValueError: If the lengths disagree, a shard is larger than its split, or
            ``world_size``/``rank`` are out of range, or ``out`` has the wrong size.
        TypeError: If ``out`` has a dtype other than ``dtype``.

    Example:
        >>> import torch
        >>> from hp_kernels import all_gather_copy_in
        >>> a, b = torch.ones(2, 2), torch.ones(3)
        >>> inp, outp = all_gather_copy_in([a, b], [4, 4], 2, 1, torch.bfloat16)
        >>> inp.tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_all_gather`: PyTorch
        FSDP2's copy-in (:pt:`torch.ops.fsdp.all_gather_copy_in`).
    """
    _check_world(world_size, rank)
    splits = [int(s) for s in input_split_sizes]
    if len(splits) != len(shards):
        raise ValueError(
            f"got {len(shards)} shards but {len(splits)} input_split_sizes; expected one per shard"
        )
    for i, (shard, split) in enumerate(zip(shards, splits, strict=True)):
        if split < 0 or shard.numel() > split:
            raise ValueError(
                f"shard {i} has {shard.numel()} elements but its split size is {split}; "
                "expected 0 <= numel <= split"
            )
    total = sum(splits)
    if device is None:
        if not shards:
            raise ValueError("device is required when no shard is given")
        device = shards[0].device
    if out is None:
        out = torch.empty(world_size * total, dtype=dtype, device=device)
    else:
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
        if out.dim() != 1 or out.numel() != world_size * total or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous 1-D tensor of {world_size * total} elements, "
                f"got shape {tuple(out.shape)}"
            )
    call(_all_gather_copy_in_op, [out], list(shards), splits, rank, out)
    return out.narrow(0, rank * total, total), out


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    input_split_sizes: Sequence[int],
    world_size: int,
    out: Sequence[torch.Tensor],
) -> None:
    """Split a gathered buffer into one rank-major tensor per parameter.

    Views the buffer as ``[world_size, sum(input_split_sizes)]`` and copies column block ``i`` to
    ``out[i]``: afterwards ``out[i][r * split_i:(r + 1) * split_i]`` is rank ``r``'s shard ``i``.
    Use :func:`unpadded_views` to turn ``out[i]`` into the unsharded parameter.

    Args:
        all_gather_output: Flat gathered buffer of ``world_size * sum(input_split_sizes)``
            elements.
        input_split_sizes: Per-parameter split sizes used at copy-in.
        world_size: Number of ranks that contributed.
        out: Contiguous tensors with ``world_size * input_split_sizes[i]`` elements each, of the
            buffer's dtype; written in place.

    Raises:
        ValueError: If sizes or lengths disagree.
        TypeError: If an output's dtype differs from the buffer's.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_all_gather_copy_out`:
        PyTorch FSDP2's copy-out (:pt:`torch.split_with_sizes_copy` on the ``[world, -1]`` view).
    """
    _check_world(world_size)
    splits = [int(s) for s in input_split_sizes]
    if len(splits) != len(out):
        raise ValueError(f"got {len(out)} outputs but {len(splits)} input_split_sizes")
    if all_gather_output.numel() != world_size * sum(splits):
        raise ValueError(
            f"all_gather_output has {all_gather_output.numel()} elements, expected "
            f"world_size * sum(input_split_sizes) = {world_size * sum(splits)}"
        )
    dtype = all_gather_output.dtype
    # Only the element counts are checked up front (``split_with_sizes_copy`` would resize a
    # wrong-sized output); a wrong dtype or layout makes the copy raise, and then the
    # per-output explanation replaces its message.
    if [o.numel() for o in out] != [world_size * s for s in splits]:
        _explain_bad_copy_out(out, splits, world_size, dtype)
    try:
        call(
            _all_gather_copy_out_op,
            [all_gather_output],
            all_gather_output,
            splits,
            world_size,
            list(out),
        )
    except RuntimeError:
        _explain_bad_copy_out(out, splits, world_size, dtype)
        raise


def _explain_bad_copy_out(
    out: Sequence[torch.Tensor], splits: Sequence[int], world_size: int, dtype: torch.dtype
) -> None:
    for i, (o, split) in enumerate(zip(out, splits, strict=True)):
        if o.dtype != dtype:
            raise TypeError(f"out[{i}] has dtype {o.dtype}, expected the buffer dtype {dtype}")
        if o.numel() != world_size * split or not o.is_contiguous():
            raise ValueError(
                f"out[{i}] must be contiguous with {world_size * split} elements, "
                f"got shape {tuple(o.shape)}"
            )


def unpadded_views(
    gathered: torch.Tensor,
    padded_shape: Sequence[int],
    global_shape: Sequence[int],
    shard_dim: int,
    world_size: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn a rank-major gathered parameter into the unsharded parameter, dropping padding.

    ``gathered`` holds ``world_size`` blocks, block ``r`` being rank ``r``'s padded shard of
    shape ``padded_shape`` (``torch.chunk`` semantics along ``shard_dim``: full chunks first, so
    padding is always a suffix of the concatenation). For ``shard_dim == 0`` the result is a view
    of ``gathered`` (no copy); for other dims the blocks are concatenated along ``shard_dim``,
    which needs a copy (into ``out`` when given).

    Args:
        gathered: Contiguous tensor of ``world_size * prod(padded_shape)`` elements (one of the
            outputs of :func:`all_gather_copy_out`).
        padded_shape: Shape of one rank's padded shard.
        global_shape: Shape of the unsharded parameter.
        shard_dim: Dimension the parameter is sharded on (negative counts from the end).
        world_size: Number of shards.
        out: Keyword-only extension: tensor of ``global_shape`` to write the result into (a copy
            is made even for ``shard_dim == 0``).

    Returns:
        The unsharded parameter of ``global_shape``: a view of ``gathered`` when
        ``shard_dim == 0`` and ``out`` is None, else a new tensor (or ``out``).

    Raises:
        ValueError: If the shapes are inconsistent.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.init_unsharded_param`:
        PyTorch FSDP2's unpadded views of the all-gather output.
    """
    # Argument checks cost more than the view itself, so they are kept to tuple comparisons
    # (the shard-dim sizes and the element count are checked by ``view``/``narrow`` below).
    padded = tuple(padded_shape)
    glob = tuple(global_shape)
    ndim = len(glob)
    if (
        out is None
        and ndim
        and (shard_dim == 0 or shard_dim == -ndim)
        and glob[1:] == padded[1:]
        and type(world_size) is int
        and world_size >= 1
        and glob[0] >= 0
    ):
        # The common case (a dim-0 view) in as few Python steps as torch's own view: ``view``
        # checks the element count and ``narrow`` the dim-0 bound; a failure falls through to
        # the checks below, which raise the explanatory error.
        try:
            view = gathered.view(world_size * padded[0], *padded[1:])
            return view if glob[0] == view.shape[0] else view.narrow(0, 0, glob[0])
        except RuntimeError:
            pass
    if (
        not isinstance(world_size, int)
        or world_size < 1
        or len(padded) != ndim
        or not -ndim <= shard_dim < ndim
    ):
        _check_world(world_size)
        if len(padded) != ndim:
            raise ValueError(
                f"padded_shape {list(padded)} and global_shape {list(glob)} differ in rank"
            )
        if ndim == 0:
            raise ValueError("cannot shard a 0-d parameter")
        raise ValueError(f"shard_dim {shard_dim} is out of range for a {ndim}-d parameter")
    dim = shard_dim % ndim
    if (
        glob[:dim] != padded[:dim]
        or glob[dim + 1 :] != padded[dim + 1 :]
        or not 0 <= glob[dim] <= padded[dim] * world_size
        or gathered.numel() != world_size * math.prod(padded)
    ):
        if gathered.numel() != world_size * math.prod(padded):
            raise ValueError(
                f"gathered has {gathered.numel()} elements, expected world_size * "
                f"prod(padded_shape) = {world_size * math.prod(padded)}"
            )
        raise ValueError(
            f"global_shape {list(glob)} does not fit {world_size} shards of padded_shape "
            f"{list(padded)} on dim {dim}"
        )
    if out is not None and tuple(out.shape) != glob:
        raise ValueError(f"out has shape {list(out.shape)}, expected {list(glob)}")
    if dim == 0:
        view = gathered.view(world_size * padded[0], *padded[1:]).narrow(0, 0, glob[0])
        if out is None:
            return view
        out.copy_(view)
        return out
    # Rank blocks along dim 0, concatenated along ``dim`` with one ``cat`` (measured faster on
    # CPU than a reshape of the moved-dim view). Padding is a suffix of the concatenation, so
    # each block is first narrowed to its unpadded part (one copy in all, never two).
    blocks = gathered.view([world_size * padded[0], *padded[1:]]).chunk(world_size, 0)
    width = padded[dim]
    if glob[dim] != world_size * width:
        kept = glob[dim]
        blocks = tuple(
            b.narrow(dim, 0, min(width, kept - r * width))
            for r, b in enumerate(blocks)
            if kept > r * width
        )
    if out is None:
        return torch.cat(blocks, dim)
    return torch.cat(blocks, dim, out=out)
