"""Micro-batching: split a step's arguments into micro-batches and merge the outputs back.

Tensors are cut along a chunk dimension (``0`` unless a spec says otherwise); everything that is
not a tensor is passed unchanged to every micro-batch. A spec is any object with an integer
``split_dim`` attribute: this module's :class:`TensorChunkSpec` or PyTorch's
``torch.distributed.pipelining.microbatch.TensorChunkSpec`` (recognised by that attribute, so
either works in a schedule's ``args_chunk_spec``/``kwargs_chunk_spec``/``output_merge_spec``).
An output spec may also be a reducer: an object with ``init_value`` and ``reduce_fn`` (PyTorch's
``_CustomReducer``), which folds the micro-batch values instead of concatenating them.

A batch dimension that ``n_microbatches`` does not divide is split as PyTorch splits it
(``torch.tensor_split``: the first ``size % n`` micro-batches hold one sample more); a batch
smaller than ``n_microbatches`` raises :class:`ValueError` naming both numbers. With uneven
micro-batches a mean-reduced loss averages per micro-batch, so the shorter micro-batches'
samples weigh more than in a mean over the full batch (as in PyTorch); a sum-reduced loss with
``scale_grads=False`` gives exactly the full batch's gradients. The stages carry each
micro-batch's shapes (see :mod:`hp_pp.stage`).

See Also:
    :pt:`torch.distributed.pipelining.microbatch`: ``TensorChunkSpec``,
    ``split_args_kwargs_into_chunks``, ``merge_chunks``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorChunkSpec", "merge_chunks", "split_args_kwargs_into_chunks"]


@dataclass(frozen=True)
class TensorChunkSpec:
    """Cut a tensor argument (or merge a tensor output) along ``split_dim``.

    Attributes:
        split_dim: The dimension that holds the batch.

    See Also:
        :pt:`torch.distributed.pipelining.microbatch.TensorChunkSpec`
    """

    split_dim: int

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> Any:
        """Specs for positional arguments from their chunk dimensions.

        Args:
            chunk_dims: One dimension per positional argument; nested tuples, lists and dicts
                of dimensions give the same structure of specs.

        Returns:
            The same structure with each ``int`` replaced by ``TensorChunkSpec(int)``, e.g.
            ``TensorChunkSpec.from_tuple((0, 0, 1))`` cuts the third argument along dim 1.

        Raises:
            TypeError: ``chunk_dims`` holds something other than ints and containers of ints.

        See Also:
            :pt:`torch.distributed.pipelining.microbatch.TensorChunkSpec`
        """
        return _specs_of(chunk_dims, "TensorChunkSpec.from_tuple")

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]) -> Any:
        """Specs for keyword arguments from their chunk dimensions.

        Args:
            chunk_dims: A chunk dimension per keyword, e.g. ``{"ids": 0, "mask": 1}``.

        Returns:
            A dict with the same keys and ``TensorChunkSpec(dim)`` values.

        Raises:
            TypeError: ``chunk_dims`` holds something other than ints and containers of ints.

        See Also:
            :pt:`torch.distributed.pipelining.microbatch.TensorChunkSpec`
        """
        return _specs_of(chunk_dims, "TensorChunkSpec.from_dict")


def _specs_of(dims: Any, where: str) -> Any:
    """``dims`` with every int replaced by its :class:`TensorChunkSpec` (same nesting)."""
    if isinstance(dims, bool) or not isinstance(dims, int | tuple | list | dict):
        raise TypeError(
            f"{where}: expected chunk dimensions (ints, or tuples/lists/dicts of them), got "
            f"{dims!r} of type {type(dims).__name__}"
        )
    if isinstance(dims, int):
        return TensorChunkSpec(dims)
    if isinstance(dims, dict):
        return {k: _specs_of(v, where) for k, v in dims.items()}
    return type(dims)(_specs_of(d, where) for d in dims)


def _split_dim_of(spec: Any, where: str) -> int | None:
    """The chunk dimension a spec names; ``None`` for a spec that replicates the value."""
    if spec is None:
        return 0
    split_dim = getattr(spec, "split_dim", None)
    if isinstance(split_dim, int):
        return split_dim
    if type(spec).__name__ == "_Replicate":  # torch's replicate marker
        return None
    raise TypeError(
        f"{where}: expected a chunk spec with an integer split_dim (TensorChunkSpec), got {spec!r}"
    )


def _split_value(value: Any, spec: Any, n: int, where: str) -> list[Any]:
    if not isinstance(value, torch.Tensor):
        return [value] * n
    dim = _split_dim_of(spec, where)
    if dim is None:
        return [value] * n
    if value.dim() == 0:
        raise ValueError(f"{where}: cannot split a 0-d tensor into {n} micro-batches")
    size = value.size(dim)
    if size < n:
        raise ValueError(
            f"{where}: batch size {size} (dim {dim}) is smaller than n_microbatches={n} (every "
            "micro-batch needs at least one sample)"
        )
    # torch's split: the first size % n micro-batches hold one sample more.
    return list(torch.tensor_split(value, n, dim=dim))


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: tuple[Any, ...] | None = None,
    kwargs_chunk_spec: dict[str, Any] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split positional and keyword arguments into ``chunks`` micro-batches.

    Args:
        args: Positional arguments of the step.
        kwargs: Keyword arguments of the step (``None`` for none).
        chunks: Number of micro-batches.
        args_chunk_spec: One spec per positional argument (``None``: dim 0 for every tensor).
        kwargs_chunk_spec: A spec per keyword (``None`` or a missing key: dim 0).

    Returns:
        The per-micro-batch positional tuples and keyword dicts.

    Raises:
        ValueError: ``chunks`` < 1, a spec tuple of the wrong length, or a batch dimension
            smaller than ``chunks``.
        TypeError: a spec without an integer ``split_dim``.

    See Also:
        :pt:`torch.distributed.pipelining.microbatch.split_args_kwargs_into_chunks`
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks (n_microbatches) must be an int >= 1, got {chunks!r}")
    kwargs = kwargs or {}
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise ValueError(
            f"args_chunk_spec has {len(args_chunk_spec)} entries but step got {len(args)} "
            "positional arguments"
        )
    arg_specs: Sequence[Any] = (
        args_chunk_spec if args_chunk_spec is not None else [None] * len(args)
    )
    kw_specs: Mapping[str, Any] = kwargs_chunk_spec or {}
    split_args = [
        _split_value(a, s, chunks, f"positional argument {i}")
        for i, (a, s) in enumerate(zip(args, arg_specs, strict=True))
    ]
    split_kwargs = {
        k: _split_value(v, kw_specs.get(k), chunks, f"keyword argument {k!r}")
        for k, v in kwargs.items()
    }
    arg_chunks = [tuple(parts[i] for parts in split_args) for i in range(chunks)]
    kwarg_chunks = [{k: parts[i] for k, parts in split_kwargs.items()} for i in range(chunks)]
    return arg_chunks, kwarg_chunks


def _merge_values(values: list[Any], spec: Any) -> Any:
    reduce_fn = getattr(spec, "reduce_fn", None)
    if reduce_fn is not None:
        acc = getattr(spec, "init_value", None)
        for v in values:
            acc = reduce_fn(acc, v)
        return acc
    first = values[0]
    if isinstance(first, torch.Tensor):
        dim = _split_dim_of(spec, "output_merge_spec")
        if dim is None:
            return first
        if first.dim() == 0:
            return torch.stack(values)
        return torch.cat(values, dim=dim)
    if isinstance(first, tuple | list):
        specs = spec if isinstance(spec, tuple | list) else [spec] * len(first)
        merged = [_merge_values([v[i] for v in values], specs[i]) for i in range(len(first))]
        return type(first)(merged)
    if isinstance(first, dict):
        specs_d = spec if isinstance(spec, dict) else {}
        return {k: _merge_values([v[k] for v in values], specs_d.get(k)) for k in first}
    return first


def merge_chunks(chunks: list[Any], chunk_spec: Any = None) -> Any:
    """Merge per-micro-batch outputs into one output.

    Tensors are concatenated along the spec's ``split_dim`` (dim 0 by default; 0-d tensors are
    stacked); tuples, lists and dicts are merged element-wise (the spec may mirror their
    structure); a reducer spec (``init_value`` and ``reduce_fn``) folds the values; any other
    value is taken from the first micro-batch.

    Args:
        chunks: The outputs of each micro-batch, in order.
        chunk_spec: ``None``, a spec, or a tuple/dict of specs mirroring the output.

    Returns:
        The merged output.

    Raises:
        ValueError: ``chunks`` is empty.

    See Also:
        :pt:`torch.distributed.pipelining.microbatch.merge_chunks`
    """
    if not chunks:
        raise ValueError("merge_chunks needs at least one micro-batch output")
    return _merge_values(list(chunks), chunk_spec)
