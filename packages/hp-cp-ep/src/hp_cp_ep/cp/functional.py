"""PyTorch's functional context-parallel API, on the hyper-parallel engine (CPU included).

``context_parallel`` shards the given buffers along their sequence dimension in place and, while
active, makes ``F.scaled_dot_product_attention`` context-parallel; on exit it restores the
buffers. ``set_rotate_method`` picks how K/V reach the queries, as in PyTorch: ``"allgather"``
(the default) or ``"alltoall"`` (PyTorch's name for passing K/V shards around: our ring); the
hyper-parallel names ``"ring"``, ``"allgather"`` and ``"ulysses"`` are accepted too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp._sdpa_redirect import SdpaRoute, active_route
from hp_cp_ep.cp.attention import ContextParallelAttention
from hp_cp_ep.cp.load_balance import shard_sequence, unshard_sequence
from hp_dtensor._eager import run_eagerly

__all__ = [
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_unshard",
    "get_rotate_method",
    "set_rotate_method",
]

_ROTATE_ALIASES = {
    "alltoall": "ring",
    "ring": "ring",
    "allgather": "allgather",
    "ulysses": "ulysses",
}


class _RotateDefault:
    """The process-wide rotate method (PyTorch's ``set_rotate_method`` is process-wide too)."""

    mode = "allgather"


_DEFAULT = _RotateDefault()


def set_rotate_method(rotate_method: str) -> None:
    """Choose how :func:`context_parallel` moves K/V between ranks (process-wide default).

    Args:
        rotate_method: ``"allgather"`` (PyTorch's default: gather K/V, keep Q local) or
            ``"alltoall"`` (PyTorch's name for rotating K/V shards: our ring attention), or one
            of hyper-parallel's mode names ``"ring"``, ``"allgather"``, ``"ulysses"``.

    Raises:
        ValueError: Any other name.

    See Also:
        :pt:`torch.distributed.tensor.experimental._attention.set_rotate_method`
    """
    if rotate_method not in _ROTATE_ALIASES:
        raise ValueError(
            f"rotate_method must be one of {sorted(_ROTATE_ALIASES)}; got {rotate_method!r}"
        )
    _DEFAULT.mode = _ROTATE_ALIASES[rotate_method]


def get_rotate_method() -> str:
    """The context-parallel mode :func:`context_parallel` uses when none is given.

    See Also:
        :pt:`torch.distributed.tensor.experimental._attention.set_rotate_method`
    """
    return _DEFAULT.mode


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    mode: str | None = None,
    load_balance: bool = True,
    document_ids: torch.Tensor | None = None,
) -> Iterator[None]:
    """Run ``F.scaled_dot_product_attention`` context-parallel over ``mesh`` inside the block.

    On entry every buffer is sharded in place along its sequence dimension (head-tail "zigzag"
    sharding when ``load_balance``, as PyTorch does by default); inside the block SDPA calls on
    the local shards compute attention over the whole sequence; on exit the buffers not in
    ``no_restore_buffers`` get their full contents back. On a mesh of size 1 nothing happens.
    Run the backward inside the block when activation checkpointing recomputes attention there
    (the recomputation must be context-parallel too), as with PyTorch's. As PyTorch's, the
    routing is process-wide (``F.scaled_dot_product_attention`` is replaced while the block
    runs): the autograd engine recomputes checkpointed blocks with no ``TorchFunctionMode``
    active, on accelerators on its own thread.

    Args:
        mesh: The context-parallel mesh (1-D; 2-D ``(outer, ulysses)`` for the hybrids).
        buffers: Tensors with a sequence dimension (inputs, labels, positions, RoPE tables).
            Not parameters.
        buffer_seq_dims: The sequence dimension of each buffer.
        no_restore_buffers: Buffers (a subset of ``buffers``) left sharded on exit.
        mode: Keyword-only extension: ``"ring"``, ``"allgather"``, ``"ulysses"`` or
            ``"hybrid"``; default :func:`get_rotate_method`.
        load_balance: Keyword-only extension: head-tail sharding (default, as PyTorch's).
        document_ids: Keyword-only extension: ``[seq]`` or ``[batch, seq]`` integer document
            ids of the whole sequence (packed documents; not modified). They are sharded like
            the buffers and go with every SDPA call, so a query attends only to keys of its
            own document. Every mode.

    Yields:
        Nothing; SDPA is redirected while the block runs.

    Raises:
        ValueError: Buffers and dims of different lengths, ``no_restore_buffers`` not a subset
            of ``buffers``, a sequence length not divisible, or (inside) an unsupported SDPA
            call: a dense ``attn_mask`` or dropout.

    Example:
        >>> # with context_parallel(cp_mesh, buffers=[tokens, labels], buffer_seq_dims=[1, 1]):
        >>> #     loss = loss_fn(model(tokens), labels)
        >>> #     loss.backward()

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's version (CUDA
        attention kernels only; same signature).
    """
    bufs = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    if len(bufs) != len(dims):
        raise ValueError(
            f"buffers and buffer_seq_dims must have the same length; got {len(bufs)} buffers "
            f"and {len(dims)} dims"
        )
    keep = list(no_restore_buffers or ())
    if any(not any(k is b for b in bufs) for k in keep):
        raise ValueError("no_restore_buffers must be a subset of buffers")
    if mesh.size() == 1 and document_ids is None:
        yield
        return
    engine = ContextParallelAttention(mesh, mode=mode or _DEFAULT.mode, load_balance=load_balance)
    local_documents = None
    if document_ids is not None:
        local_documents = shard_sequence(document_ids, mesh, -1, load_balance=load_balance)
    shards = [
        shard_sequence(b, mesh, d, load_balance=load_balance)
        for b, d in zip(bufs, dims, strict=True)
    ]
    originals = [None if any(k is b for k in keep) else b.clone() for b in bufs]
    for buffer, shard in zip(bufs, shards, strict=True):
        buffer.resize_(shard.shape).copy_(shard)
    try:
        with SdpaRoute(engine, local_documents):
            yield
    finally:
        for buffer, original in zip(bufs, originals, strict=True):
            if original is not None:
                buffer.resize_(original.shape).copy_(original)


@functools.partial(run_eagerly, reason="the CP engine runs eagerly")
def _attend(
    route: SdpaRoute,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    sinks: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    # opaque to torch.compile: collectives and autograd functions with Python state run
    # eagerly, a graph break between the compiled pieces (as the SDPA route)
    return route.attend(query, key, value, mask, sinks, scale)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: Any,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | None:
    """Attention with a mask description inside :func:`context_parallel`; None outside it.

    SDPA's arguments cannot say "a sliding window of W" or carry attention sinks without a
    dense mask, which context parallelism cannot take (it would be the whole sequence's).
    A model whose layers describe their masks calls this first: inside a
    :func:`context_parallel` block it returns this rank's shard of the attention over the
    whole sequence (the block's engine, rotate method, document ids and per-batch plan), and
    outside one it returns None, for the caller to attend on one device as usual.

    Args:
        query: ``[B, H, s, D]`` this rank's shard.
        key: ``[B, Hkv, s, D]`` this rank's shard (``H`` divisible by ``Hkv``).
        value: ``[B, Hkv, s, Dv]`` this rank's shard.
        mask: The mask description: an object with the fields ``causal``, ``documents``,
            ``sliding_window``, ``chunk_size`` and ``prefix_length`` (hp-trainer's
            ``MaskSpec``); the block's document ids apply whenever it has them.
        sinks: ``[H]`` attention-sink logits, or None.
        scale: Softmax scale (default ``1 / sqrt(D)``).

    Returns:
        The local shard of the output ``[B, H, s, Dv]``, or None when no
        :func:`context_parallel` block is active.

    Raises:
        ValueError: A mask the engine cannot express, or sinks that are not ``[H]``
            (:class:`ContextParallelAttention`).
        TypeError: A ``mask`` without the fields above.

    Example:
        >>> # out = context_parallel_attention(q, k, v, mask=MaskSpec(sliding_window=128))
        >>> # if out is None:  # not context-parallel
        >>> #     out = my_single_device_attention(q, k, v)

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's context
        parallelism, which routes SDPA calls only (causal or no mask).
    """
    route = active_route()
    if route is None:
        return None
    out: torch.Tensor = _attend(route, query, key, value, mask, sinks, scale)
    return out


def context_parallel_unshard(
    mesh: DeviceMesh,
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    load_balancer: None = None,
    *,
    load_balance: bool = True,
) -> list[torch.Tensor]:
    """Gather sequence-sharded tensors (e.g. outputs inside :func:`context_parallel`) whole.

    Args:
        mesh: The context-parallel mesh.
        buffers: Local shards.
        seq_dims: Their sequence dimensions.
        load_balancer: PyTorch's private load-balancer object is not supported; must be None.
        load_balance: Keyword-only extension: the shards are head-tail shards (default, as
            :func:`context_parallel` shards by default).

    Returns:
        The full tensors, in sequence order, on every rank (not differentiable).

    Raises:
        ValueError: Lengths of ``buffers`` and ``seq_dims`` differ.
        TypeError: ``load_balancer`` is not None.

    See Also:
        :pt:`context_parallel_unshard
        <torch.distributed.tensor.experimental._context_parallel._attention.context_parallel_unshard>`
    """
    if load_balancer is not None:
        raise TypeError(
            "load_balancer objects are PyTorch-private; pass load_balance=True/False instead, "
            f"got {type(load_balancer).__name__}"
        )
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"buffers and seq_dims must have the same length; got {len(buffers)} and "
            f"{len(seq_dims)}"
        )
    return [
        unshard_sequence(b, mesh, d, load_balance=load_balance)
        for b, d in zip(buffers, seq_dims, strict=True)
    ]
