"""Context parallelism for the trainer: shard one step's sequences and run attention CP.

:class:`ContextParallelStep` shards the inputs, the labels and every model part's RoPE table
along the sequence with head-tail load balancing (rank ``r`` of ``cp`` holds chunks ``r`` and
``2 * cp - 1 - r``), and routes the models' ``F.scaled_dot_product_attention`` calls to
hp-cp-ep's engine (ring, Ulysses, all-gather-KV, or the ring x Ulysses hybrid) while the step
runs. The loss of each rank is its shard's token sum over the step's global token count, so
summing it over ``dp x cp`` (and FSDP summing gradients over ``dp_shard x cp``) gives the
numbers of one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp import context_parallel, shard_sequence

if TYPE_CHECKING:
    from hp_trainer.config import ParallelismConfig
    from hp_trainer.protocols.model_spec import ModelSpec

__all__ = ["CP_ROTATE_METHODS", "ContextParallelStep", "supports_context_parallel"]

CP_ROTATE_METHODS = ("allgather", "alltoall", "ring", "ulysses", "hybrid")
"""Values of ``parallelism.context_parallel_rotate_method``: TorchTitan's ``allgather`` and
``alltoall`` (passing K/V shards around: the ring), and hyper-parallel's ``ring``, ``ulysses``
and ``hybrid`` (Ulysses inside groups of ``context_parallel_ulysses_degree`` ranks, ring across
them)."""

_ENGINE_MODE = {
    "allgather": "allgather",
    "alltoall": "ring",
    "ring": "ring",
    "ulysses": "ulysses",
    "hybrid": "hybrid",
}


def supports_context_parallel(spec: ModelSpec) -> bool:
    """Whether a model family runs its attention through SDPA with a shardable RoPE table.

    A spec opts in with ``extra["context_parallel"] = True``: its attention calls
    ``F.scaled_dot_product_attention`` (causal, no dense mask) and its RoPE table is the
    buffer ``rope_cache`` indexed by position along dim 0.

    Args:
        spec: The model family's ``ModelSpec``.

    Returns:
        True when the spec declares it.
    """
    return bool(spec.extra.get("context_parallel", False))


class ContextParallelStep:
    """Shards of one step's buffers and the context-parallel attention around the step.

    Args:
        cp_mesh: The 1-D context-parallel mesh.
        parallelism: The ``[parallelism]`` section (rotate method, Ulysses degree of the hybrid).

    See Also:
        :titan:`torchtitan.distributed.utils.create_context_parallel_ctx`: TorchTitan's helper
        (``hp_cp_ep.create_context_parallel_ctx`` on our engine).
    """

    def __init__(self, cp_mesh: DeviceMesh, parallelism: ParallelismConfig) -> None:
        method = parallelism.context_parallel_rotate_method
        self.mode = _ENGINE_MODE[method]
        self.mesh = cp_mesh
        if method == "hybrid":
            ulysses = parallelism.context_parallel_ulysses_degree
            self.mesh = cp_mesh._unflatten(
                0, (cp_mesh.size() // ulysses, ulysses), ("cp_ring", "cp_ulysses")
            )

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's load-balanced shard of a whole-sequence tensor.

        Args:
            tensor: The full tensor (the same on every CP rank).
            seq_dim: Its sequence dimension.

        Returns:
            The local shard.
        """
        return shard_sequence(tensor, self.mesh, seq_dim, load_balance=True)

    @contextlib.contextmanager
    def sharded(
        self,
        model_parts: list[nn.Module],
        inputs: torch.Tensor,
        labels: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Run a forward/backward on this rank's sequence shard.

        Inside, every part's ``rope_cache`` holds the rows of this rank's positions and SDPA is
        context-parallel; on exit the RoPE tables are whole again.

        Args:
            model_parts: The model (parts) whose RoPE tables are sharded.
            inputs: ``(batch, seq)`` token ids of the whole sequence.
            labels: ``(batch, seq)`` targets of the whole sequence.
            document_ids: ``(batch, seq)`` document ids of the whole sequence (block-causal
                attention): sharded like the sequence, they go with every attention call
                (every rotate method).

        Yields:
            ``(inputs shard, labels shard)``.
        """
        seq = inputs.shape[1]
        tables: list[torch.Tensor] = [part.get_buffer("rope_cache") for part in model_parts]
        try:
            for part, table in zip(model_parts, tables, strict=True):
                part.rope_cache = self.shard(table[:seq], 0)
            with context_parallel(
                self.mesh, mode=self.mode, load_balance=True, document_ids=document_ids
            ):
                yield self.shard(inputs, 1), self.shard(labels, 1)
        finally:
            for part, table in zip(model_parts, tables, strict=True):
                part.rope_cache = table
