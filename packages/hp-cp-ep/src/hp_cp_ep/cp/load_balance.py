"""Sharding whole-sequence tensors for context parallelism, and putting them back together.

With a causal mask the last positions of a sequence attend to far more keys than the first
ones, so cutting the sequence into ``cp`` contiguous pieces leaves the last rank with most of the
work. Head-tail ("zigzag") load balancing cuts it into ``2 * cp`` chunks and gives rank ``r``
chunks ``r`` and ``2 * cp - 1 - r``: every rank then holds one early and one late chunk, and the
same amount of causal work. Inputs, labels, position ids and RoPE tables are all sharded the
same way with :func:`shard_sequence`; :func:`unshard_sequence` is its inverse.

Ranks are numbered by their flat (row-major) index in the context-parallel mesh, which may be
1-D or 2-D (the hybrid's ``(outer, ulysses)`` mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp._layout import ChunkLayout

__all__ = ["shard_sequence", "unshard_sequence"]


def _flat_rank(mesh: DeviceMesh) -> int:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the context-parallel mesh")
    flat = 0
    for dim, index in enumerate(coordinate):
        flat = flat * mesh.size(dim) + index
    return flat


def _check_dim(tensor: torch.Tensor, seq_dim: int) -> int:
    if not isinstance(seq_dim, int) or not -tensor.dim() <= seq_dim < tensor.dim():
        raise ValueError(
            f"seq_dim {seq_dim!r} is out of range for a tensor of shape {tuple(tensor.shape)}"
        )
    return seq_dim % tensor.dim()


def shard_sequence(
    tensor: torch.Tensor, mesh: DeviceMesh, seq_dim: int, *, load_balance: bool = True
) -> torch.Tensor:
    """This rank's shard of a whole-sequence tensor (inputs, labels, positions, RoPE tables).

    Args:
        tensor: The full tensor, identical on every rank of ``mesh``.
        mesh: The context-parallel mesh (1-D, or the hybrid's 2-D mesh).
        seq_dim: The sequence dimension of ``tensor``.
        load_balance: Head-tail (zigzag) sharding (chunks ``r`` and ``2 * cp - 1 - r``);
            otherwise contiguous (chunk ``r``).

    Returns:
        The local shard, a new contiguous tensor.

    Raises:
        ValueError: ``seq_dim`` out of range, or the length not divisible by ``2 * cp``
            (load-balanced) or ``cp``: pad the sequence (and mask the padding in the loss).

    Example:
        >>> # tokens: [batch, seq] on every rank; local = shard_sequence(tokens, cp_mesh, 1)

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's context manager
        shards its ``buffers`` in place the same way (head-tail for causal attention).
    """
    dim = _check_dim(tensor, seq_dim)
    layout = ChunkLayout(mesh.size(), load_balance)
    layout.check_length(tensor.shape[dim])
    if layout.cp == 1:
        return tensor
    chunks = tensor.chunk(layout.num_chunks, dim=dim)
    return torch.cat([chunks[c] for c in layout.chunks_of(_flat_rank(mesh))], dim=dim)


def unshard_sequence(
    tensor: torch.Tensor, mesh: DeviceMesh, seq_dim: int, *, load_balance: bool = True
) -> torch.Tensor:
    """The whole-sequence tensor from every rank's shard (the inverse of :func:`shard_sequence`).

    All-gathers over the mesh (not differentiable: use it for outputs, metrics and checks).

    Args:
        tensor: This rank's shard; the same shape on every rank.
        mesh: The context-parallel mesh used to shard.
        seq_dim: The sequence dimension.
        load_balance: Whether the shards are head-tail (zigzag) shards.

    Returns:
        The full tensor in sequence order, on every rank.

    Raises:
        ValueError: ``seq_dim`` out of range, or a load-balanced shard of odd length.

    See Also:
        :pt:`context_parallel_unshard
        <torch.distributed.tensor.experimental._context_parallel._attention.context_parallel_unshard>`
    """
    dim = _check_dim(tensor, seq_dim)
    layout = ChunkLayout(mesh.size(), load_balance)
    if layout.cp == 1:
        return tensor
    per_rank = layout.num_chunks // layout.cp
    if tensor.shape[dim] % per_rank:
        raise ValueError(
            f"a load-balanced shard holds 2 chunks; its length {tensor.shape[dim]} is odd"
        )
    pieces = [tensor.detach().contiguous()]
    for mesh_dim in reversed(range(mesh.ndim)):  # innermost first: row-major flat order
        group, n = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
        local = torch.cat(pieces, dim=dim)
        gathered = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(gathered, local, group=group)
        pieces = gathered
    in_rank_order = torch.cat(pieces, dim=dim).chunk(layout.num_chunks, dim=dim)
    chunks: list[torch.Tensor] = [torch.empty(0)] * layout.num_chunks
    for flat in range(layout.cp):
        for i, c in enumerate(layout.chunks_of(flat)):
            chunks[c] = in_rank_order[flat * per_rank + i]
    return torch.cat(chunks, dim=dim)
