"""The parallelize function of llama3: TP, activation checkpointing, compile, FSDP/HSDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_trainer.models.common.parallelize import parallelize_dense_decoder

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["parallelize_llama"]


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and FSDP/HSDP to a Llama 3 model.

    Args:
        model: The Llama 3 decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        :titan:`torchtitan.models.llama3.infra.parallelize.parallelize_llama`.
    """
    return parallelize_dense_decoder(model, parallel_dims, job_config)
