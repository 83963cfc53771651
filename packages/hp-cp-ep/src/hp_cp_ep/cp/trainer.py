"""TorchTitan's trainer-side context-parallel helper, on the hyper-parallel engine."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp.functional import _ROTATE_ALIASES, context_parallel

__all__ = ["create_context_parallel_ctx"]


def create_context_parallel_ctx(
    cp_mesh: DeviceMesh,
    cp_buffers: list[torch.Tensor],
    cp_seq_dims: list[int],
    cp_no_restore_buffers: set[torch.Tensor],
    cp_rotate_method: str,
    *,
    load_balance: bool = True,
) -> contextlib.AbstractContextManager[None]:
    """The context manager a trainer wraps one step's forward and backward in.

    Inside it the buffers (inputs, labels, positions, RoPE tables) are this rank's sequence
    shards and SDPA is context-parallel; on exit the buffers not in ``cp_no_restore_buffers``
    are whole again. Unlike TorchTitan (which calls PyTorch's process-wide
    ``set_rotate_method``) the rotate method applies to this context only.

    Args:
        cp_mesh: The context-parallel mesh.
        cp_buffers: Tensors to shard along the sequence.
        cp_seq_dims: Their sequence dimensions.
        cp_no_restore_buffers: Buffers left sharded on exit (usually inputs and labels).
        cp_rotate_method: ``"allgather"`` or ``"alltoall"`` (TorchTitan's names; ``"alltoall"``
            is ring attention here), or ``"ring"`` / ``"ulysses"``.
        load_balance: Keyword-only extension: head-tail sharding (default).

    Returns:
        A context manager (a no-op on a CP mesh of size 1).

    Raises:
        ValueError: Unknown rotate method.

    Example:
        >>> # with create_context_parallel_ctx(mesh, [x, y], [1, 1], {x, y}, "alltoall"):
        >>> #     loss_fn(model(x), y).backward()

    See Also:
        :titan:`torchtitan.distributed.utils.create_context_parallel_ctx`: TorchTitan's helper over
        PyTorch's :pt:`context_parallel <torch.distributed.tensor.experimental.context_parallel>`.
    """
    if cp_rotate_method not in _ROTATE_ALIASES:
        raise ValueError(
            f"cp_rotate_method must be one of {sorted(_ROTATE_ALIASES)}; got {cp_rotate_method!r}"
        )
    return context_parallel(
        cp_mesh,
        buffers=cp_buffers,
        buffer_seq_dims=cp_seq_dims,
        no_restore_buffers=cp_no_restore_buffers,
        mode=_ROTATE_ALIASES[cp_rotate_method],
        load_balance=load_balance,
    )
