"""Which samples each replica group reads under fault tolerance (the data rule)."""

from __future__ import annotations

import torch

from hp_trainer.components.data.dataset import ParallelAwareDataloader

__all__ = ["replica_batches", "replica_sample_indices"]


def replica_sample_indices(
    cursor: int,
    replica_rank: int,
    num_replicas: int,
    dp_rank: int,
    dp_degree: int,
    batch_size: int,
    micro_batches: int,
) -> list[list[int]]:
    """Stream positions one rank reads in one step: the fault-tolerant data rule.

    The job reads one global sample stream (the seeded per-epoch permutations of
    :class:`~hp_trainer.ParallelAwareDataloader`). A step that starts at position ``cursor``
    with ``num_replicas`` participating replica groups gives each micro-batch ``a`` the
    positions ``[cursor + a*G, cursor + (a+1)*G)``, ``G = batch_size * dp_degree *
    num_replicas``; the group of quorum rank ``replica_rank`` takes slice ``replica_rank`` of
    it and its data-parallel rank ``dp_rank`` slice ``dp_rank`` of that. The cursor moves by
    ``micro_batches * G`` only when the step commits, and it travels with the recovery state:
    positions of a discarded step are read again by the next step, so no committed step reads
    a sample twice and none is skipped, whoever participates.

    Args:
        cursor: Stream position at the start of the step (same on every participant).
        replica_rank: This group's rank in the step's quorum.
        num_replicas: Replica groups participating in the step.
        dp_rank: Data-parallel rank inside the group.
        dp_degree: Data-parallel degree inside the group.
        batch_size: Samples per micro-batch per rank.
        micro_batches: Gradient-accumulation micro-batches per step.

    Returns:
        One list of stream positions per micro-batch.
    """
    group_batch = batch_size * dp_degree
    step_batch = group_batch * num_replicas
    offset = replica_rank * group_batch + dp_rank * batch_size
    return [
        list(range(cursor + a * step_batch + offset, cursor + a * step_batch + offset + batch_size))
        for a in range(micro_batches)
    ]


def replica_batches(
    loader: ParallelAwareDataloader, positions: list[list[int]]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """The micro-batches at stream ``positions`` (from :func:`replica_sample_indices`).

    Args:
        loader: The loader whose dataset, seed and shuffle define the stream.
        positions: Stream positions per micro-batch.

    Returns:
        ``(micro-batches, dataset indices read)``.
    """
    n = len(loader.dataset)
    orders: dict[int, torch.Tensor] = {}
    batches = []
    read: list[int] = []
    for micro in positions:
        indices = []
        for pos in micro:
            epoch = pos // n
            if epoch not in orders:
                orders[epoch] = loader._order(epoch)
            indices.append(int(orders[epoch][pos % n]))
        pairs = [loader.dataset.sample(i) for i in indices]
        batches.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        read.extend(indices)
    return batches, read
