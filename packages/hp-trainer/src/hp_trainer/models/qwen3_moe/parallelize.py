"""Qwen 3 MoE's parallelize function: the shared MoE plan (TP, EP, AC, compile, FSDP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_trainer.models.common.expert_parallel import parallelize_moe_decoder

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["parallelize_qwen3_moe"]


def parallelize_qwen3_moe(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, EP, AC, compile and FSDP (experts on the ``efsdp`` mesh) to a Qwen 3 MoE model.

    Args:
        model: The Qwen 3 MoE decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        :titan:`torchtitan.models.qwen3.infra.parallelize.parallelize_qwen3`.
    """
    return parallelize_moe_decoder(model, parallel_dims, job_config)
