"""Context parallelism for the trainer: shard one step's sequences and run attention CP.

:class:`ContextParallelStep` shards the inputs, the labels and every model part's position
buffers (its sharding table's ``cp`` section: the RoPE table) along the sequence with head-tail
load balancing (rank ``r`` of ``cp`` holds chunks ``r`` and ``2 * cp - 1 - r``), and routes
the models' ``F.scaled_dot_product_attention`` calls to hp-cp-ep's engine (ring, Ulysses,
all-gather-KV, or the ring x Ulysses hybrid) while the step runs. The loss of each rank is its
shard's token sum over the step's global token count, so summing it over ``dp x cp`` (and FSDP
summing gradients over ``dp_shard x cp``) gives the numbers of one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp import context_parallel, shard_sequence
from hp_trainer.distributed.sharding import context_parallel_buffers

if TYPE_CHECKING:
    from hp_trainer.config import ParallelismConfig
    from hp_trainer.protocols.model_spec import ModelSpec

__all__ = [
    "CP_ROTATE_METHODS",
    "ContextParallelStep",
    "create_context_parallel_ctx",
    "supports_context_parallel",
]

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


def create_context_parallel_ctx(
    cp_mesh: DeviceMesh,
    cp_buffers: list[torch.Tensor],
    cp_seq_dims: list[int],
    cp_no_restore_buffers: set[torch.Tensor],
    cp_rotate_method: str,
    *,
    load_balance: bool = True,
) -> contextlib.AbstractContextManager[None]:
    """TorchTitan's trainer-side context manager, on hp-cp-ep's engine.

    Wrap one step's forward and backward in it: inside, the buffers (inputs, labels, positions,
    RoPE tables) are this rank's sequence shards and SDPA is context-parallel; on exit the
    buffers not in ``cp_no_restore_buffers`` are whole again. The rotate method applies to this
    context only (TorchTitan sets PyTorch's process-wide one).

    Args:
        cp_mesh: The 1-D context-parallel mesh.
        cp_buffers: Tensors to shard along the sequence.
        cp_seq_dims: Their sequence dimensions.
        cp_no_restore_buffers: Buffers left sharded on exit (usually inputs and labels).
        cp_rotate_method: ``"allgather"`` or ``"alltoall"`` (TorchTitan's names; ``"alltoall"``
            passes K/V shards around a ring), or ``"ring"`` / ``"ulysses"``.
        load_balance: Keyword-only extension: head-tail sharding (default).

    Returns:
        The context manager (nothing to do on a mesh of size 1).

    Raises:
        ValueError: An unknown rotate method (``"hybrid"`` needs the trainer's 2-D mesh:
            :class:`ContextParallelStep`).

    Example:
        >>> # with create_context_parallel_ctx(mesh, [x, y], [1, 1], {x, y}, "alltoall"):
        >>> #     loss_fn(model(x), y).backward()

    See Also:
        :titan:`torchtitan.distributed.utils.create_context_parallel_ctx`: TorchTitan's helper
        over PyTorch's
        :pt:`context_parallel <torch.distributed.tensor.experimental.context_parallel>`.
    """
    methods = [m for m in CP_ROTATE_METHODS if m != "hybrid"]
    if cp_rotate_method not in methods:
        raise ValueError(f"cp_rotate_method must be one of {methods}; got {cp_rotate_method!r}")
    return context_parallel(
        cp_mesh,
        buffers=cp_buffers,
        buffer_seq_dims=cp_seq_dims,
        no_restore_buffers=cp_no_restore_buffers,
        mode=_ENGINE_MODE[cp_rotate_method],
        load_balance=load_balance,
    )


def supports_context_parallel(spec: ModelSpec) -> bool:
    """Whether a model family runs its attention through SDPA with shardable position buffers.

    A spec opts in with a sharding table whose ``cp`` section places its buffers indexed by
    position (``ModelSpec.sharding``; its parallelize function applies that table), or, for
    a family without a table, ``ModelSpec.context_parallel = True`` (its parallelize function
    then calls :func:`hp_trainer.apply_sharding` with ``cp_mesh``
    itself). Its attention calls ``F.scaled_dot_product_attention`` (causal, no dense mask).

    Args:
        spec: The model family's ``ModelSpec``.

    Returns:
        True when the spec declares it.
    """
    sharding = getattr(spec, "sharding", None)
    if sharding is not None and sharding.cp:
        return True
    return spec.context_parallel


class ContextParallelStep:
    """Shards of one step's buffers and the context-parallel attention around the step.

    Args:
        cp_mesh: The 1-D context-parallel mesh.
        parallelism: The ``[parallelism]`` section (rotate method, Ulysses degree of the hybrid).

    See Also:
        :titan:`torchtitan.distributed.utils.create_context_parallel_ctx`: TorchTitan's helper
        (:func:`create_context_parallel_ctx` here, on the same engine).
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

        Inside, every buffer the parts' sharding tables place over the CP mesh (the RoPE
        tables: :func:`~hp_trainer.distributed.sharding.context_parallel_buffers`) holds the
        rows of this rank's positions and SDPA is context-parallel; on exit the buffers are
        whole again.

        Args:
            model_parts: The model (parts) whose RoPE tables are sharded.
            inputs: ``(batch, seq)`` token ids of the whole sequence.
            labels: ``(batch, seq)`` targets of the whole sequence.
            document_ids: ``(batch, seq)`` document ids of the whole sequence (block-causal
                attention): sharded like the sequence, they go with every attention call
                (every rotate method).

        Yields:
            ``(inputs shard, labels shard)``.

        Raises:
            ValueError: A part without context-parallel placements (its parallelize function
                did not apply a table's ``cp`` section).
        """
        seq = inputs.shape[1]
        whole: list[tuple[nn.Module, str, torch.Tensor, int]] = []
        for part in model_parts:
            placements = context_parallel_buffers(part)
            if not placements:
                raise ValueError(
                    f"model part {type(part).__name__} has no context-parallel placements: its "
                    "parallelize function must give its sharding table (a cp section naming the "
                    "buffers indexed by position) to apply_sharding with cp_mesh"
                )
            for fqn, placement in placements.items():
                owner, _, name = fqn.rpartition(".")
                module = part.get_submodule(owner)
                whole.append((module, name, module.get_buffer(name), placement.dim))
        try:
            for module, name, table, dim in whole:
                setattr(module, name, self.shard(table.narrow(dim, 0, seq), dim))
            with context_parallel(
                self.mesh, mode=self.mode, load_balance=True, document_ids=document_ids
            ):
                yield self.shard(inputs, 1), self.shard(labels, 1)
        finally:
            for module, name, table, _ in whole:
                setattr(module, name, table)
