"""gpt-oss's sharding table (:data:`GPT_OSS_SHARDING`) and parallelize function.

Tensor parallel splits the attention over its heads (the projections with their biases, and
the sinks, one per head, with them); the MoE layer sees every token of the sequence on each TP
rank, its router and the experts' output biases replicated; the routed experts (biases
included) go over the expert mesh as hp-cp-ep's styles place them. Under context parallelism
the RoPE table is sharded with the inputs and each attention hands its window and sinks to
hp-cp-ep's engine (``hp_cp_ep.cp.context_parallel_attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hp_tp import NoParallel
from hp_trainer._parallel_api import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from hp_trainer.distributed.sharding import ComposedStyle
from hp_trainer.models.common.expert_parallel import (
    MOE_EXPERT_RULES,
    MOE_RULES,
    parallelize_moe_decoder,
)
from hp_trainer.models.common.tensor_parallel import ROPE_CP_RULES, TRUNK_RULES
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "GPT_OSS_ATTENTION_RULES",
    "GPT_OSS_MOE_RULES",
    "GPT_OSS_SHARDING",
    "SinksByHead",
    "gpt_oss_job_error",
    "parallelize_gpt_oss",
]

_SEQ = Shard(1)


class SinksByHead(ParallelStyle):
    """Shard an attention module's ``sinks`` (one logit per query head) over its heads.

    The query projection is column-parallel, so each TP rank holds a contiguous block of
    heads; the sinks become a DTensor sharded on dim 0 the same way, and the attention uses
    its local block.

    Raises:
        TypeError: If the module has no ``sinks`` parameter.
        ValueError: If the TP degree does not divide the number of sinks.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = getattr(module, "sinks", None)
        if not isinstance(sinks, nn.Parameter):
            raise TypeError(f"{type(module).__name__} has no sinks parameter to shard by head")
        if sinks.shape[0] % device_mesh.size():
            raise ValueError(
                f"tensor parallel degree {device_mesh.size()} must divide the {sinks.shape[0]} "
                "attention sinks (one per query head)"
            )
        sharded = distribute_tensor(
            sinks.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
        )
        module.register_parameter("sinks", nn.Parameter(sharded, sinks.requires_grad))
        return module


GPT_OSS_ATTENTION_RULES = (
    ShardingRule("layers.*.attention_norm", lambda o: SequenceParallel()),
    ShardingRule(
        "layers.*.attention",
        lambda o: ComposedStyle(
            SinksByHead(),
            PrepareModuleInput(
                input_layouts=(_SEQ, None), desired_input_layouts=(Replicate(), None)
            ),
        ),
    ),
    ShardingRule("layers.*.attention.wq", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wk", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wv", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wo", lambda o: RowwiseParallel(output_layouts=_SEQ)),
)
"""gpt-oss's attention over the heads: input gathered from the sequence shards, ``wq``/``wk``/
``wv`` (and biases) column-wise, the sinks by head (:class:`SinksByHead`), ``wo`` row-wise
(its bias added once) back to sequence shards."""

GPT_OSS_MOE_RULES = (
    ShardingRule("layers.*.ffn_norm", lambda o: SequenceParallel()),
    ShardingRule("layers.*.moe.expert_output_bias", lambda o: NoParallel()),
    *MOE_RULES,
)
"""The MoE layer under TP: every token on each rank (:data:`~hp_trainer.models.common.
expert_parallel.MOE_RULES`), the router's gate and the experts' output biases replicated."""

GPT_OSS_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + GPT_OSS_ATTENTION_RULES + GPT_OSS_MOE_RULES,
    ep=MOE_EXPERT_RULES,
    cp=ROPE_CP_RULES,
    description="gpt-oss (sink attention, biased MoE)",
)
"""gpt-oss's table: TP for the trunk, :data:`GPT_OSS_ATTENTION_RULES` and
:data:`GPT_OSS_MOE_RULES`; the routed experts (weights and biases) over the expert mesh; the
RoPE table under CP (the attention routes its window and sinks to the CP engine itself)."""


def parallelize_gpt_oss(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, EP, AC, compile and FSDP (experts on the ``efsdp`` mesh) to gpt-oss.

    Args:
        model: The gpt-oss decoder (or a pipeline stage of it).
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    Raises:
        ValueError: For a layout the MoE decoder refuses (degrees not dividing the heads, the
            experts or their hidden size).

    See Also:
        ``parallelize_moe_decoder``, which applies ``GPT_OSS_SHARDING``; TorchTitan's
        gpt-oss parallelize function.
    """
    return parallelize_moe_decoder(model, parallel_dims, job_config, sharding=GPT_OSS_SHARDING)


def gpt_oss_job_error(config: JobConfig) -> tuple[str, str, object, str] | None:
    """The first job option gpt-oss cannot train with (``ModelSpec.job_check``).

    ``moe.fused``: :func:`hp_kernels.mega_moe` computes the plain SwiGLU experts; gpt-oss's
    experts have biases and a clamped SwiGLU.

    Args:
        config: The job configuration.

    Returns:
        ``(section, field, value, expected)`` of the first problem, else None.
    """
    if config.moe.fused:
        return ("moe", "fused", True, "false with model.name = 'gpt_oss': the fused MoE "
                "kernel has no expert biases or clamped SwiGLU")  # fmt: skip
    return None
