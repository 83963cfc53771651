"""Llama 4's parallelize function and its sharding table (:data:`LLAMA4_SHARDING`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_trainer.models.common.expert_parallel import (
    MOE_EXPERT_RULES,
    MOE_RULES,
    parallelize_moe_decoder,
)
from hp_trainer.models.common.tensor_parallel import (
    DENSE_FFN_RULES,
    GQA_ATTENTION_RULES,
    TRUNK_RULES,
)
from hp_trainer.protocols.sharding import ShardingConfig

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["LLAMA4_SHARDING", "parallelize_llama4"]

LLAMA4_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + GQA_ATTENTION_RULES + DENSE_FFN_RULES + MOE_RULES,
    ep=MOE_EXPERT_RULES,
    description="Llama 4 (chunked/NoPE grouped-query attention, interleaved MoE)",
)
"""Llama 4's table, TP with sequence parallel for the trunk, the grouped-query attention (its
QK-norm has no weights: nothing to shard), the dense blocks' SwiGLU and the MoE blocks
(router and shared expert replicated, every token routed on each TP rank); the routed experts
over the expert mesh. No ``cp`` section (chunked attention and the NoPE blocks' position-
dependent temperature have no context-parallel path yet), so CP is refused up front."""


def parallelize_llama4(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, EP, AC, compile and FSDP (experts on the ``efsdp`` mesh) to a Llama 4 model.

    Args:
        model: The Llama 4 decoder (or a pipeline stage of it).
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.apply_moe_ep_tp`, the expert
        sharding of TorchTitan's Llama 4 recipe.
    """
    return parallelize_moe_decoder(model, parallel_dims, job_config, sharding=LLAMA4_SHARDING)
