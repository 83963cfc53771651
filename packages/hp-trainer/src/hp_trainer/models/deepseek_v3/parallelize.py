"""DeepSeek-V3's parallelize function and its sharding table (:data:`DEEPSEEK_V3_SHARDING`):
the latent attention split over its heads (latent shared), the rest as the shared MoE tables
(:mod:`hp_trainer.models.common.expert_parallel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

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
from hp_trainer.models.common.tensor_parallel import DENSE_FFN_RULES, ROPE_CP_RULES, TRUNK_RULES
from hp_trainer.models.deepseek_v3.model import MLAttention
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "DEEPSEEK_V3_SHARDING",
    "LATENT_ATTENTION_RULES",
    "LatentAttentionParallel",
    "parallelize_deepseek_v3",
]


def _sum_rotary_key_gradient(attention: MLAttention, tp_mesh: DeviceMesh) -> None:
    """Sum the gradient of the shared rotary key over the TP ranks (the forward is unchanged).

    ``k_rope`` (the last ``qk_rope_head_dim`` columns of ``wkv_a``'s output) is used directly by
    every local head, so each rank's gradient of it is that of its own heads only. The latent
    columns need no such sum: ``wkv_b`` (column-wise) already all-reduces its input gradient.
    """
    latent_size = attention.kv_lora_rank

    def hook(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        latent, k_rope = out[..., :latent_size], out[..., latent_size:]
        shared = DTensor.from_local(k_rope, tp_mesh, [Replicate()], run_check=False)
        # backward: the local gradient is read as a partial sum and all-reduced to Replicate
        return torch.cat([latent, shared.to_local(grad_placements=[Partial()])], dim=-1)

    attention.get_submodule("wkv_a").register_forward_hook(hook)


class LatentAttentionParallel(ParallelStyle):
    """The attention module's own part of the latent-attention plan.

    Checks that the module is an :class:`~hp_trainer.models.deepseek_v3.model.MLAttention` whose
    head count the TP degree divides, and sums the shared rotary key's gradient over the TP
    ranks (a hook on ``wkv_a``; its projections are sharded by their own rules).

    Raises:
        TypeError: If the module is not an ``MLAttention``.
        ValueError: If the TP degree does not divide the attention's head count.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MLAttention):
            raise TypeError(f"expected an MLAttention, got {type(module).__name__}")
        tp = device_mesh.size()
        if module.n_heads % tp != 0:
            raise ValueError(
                f"tensor parallel degree {tp} must divide the attention's {module.n_heads} heads"
            )
        _sum_rotary_key_gradient(module, device_mesh)
        return module


_SEQ = Shard(1)

LATENT_ATTENTION_RULES = (
    ShardingRule("layers.*.attention_norm", lambda o: SequenceParallel()),
    # the latent and the rotary key are shared by all heads: replicated
    ShardingRule("layers.*.attention.wkv_a", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.kv_norm", lambda o: NoParallel()),
    # the heads: the query projection and the latent's up-projection column-wise
    ShardingRule("layers.*.attention.wkv_b", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wo", lambda o: RowwiseParallel(output_layouts=_SEQ)),
    ShardingRule("layers.*.attention.wq", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wq_a", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.q_norm", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.wq_b", lambda o: ColwiseParallel()),
    # after its projections (the rotary hook goes on the replicated wkv_a): gathered input,
    # local tensors inside
    ShardingRule(
        "layers.*.attention",
        lambda o: ComposedStyle(
            LatentAttentionParallel(),
            PrepareModuleInput(
                input_layouts=(_SEQ, None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            ),
        ),
    ),
)
"""Multi-head latent attention split over its heads: ``wq`` (or ``wq_b`` after the replicated
``wq_a``/``q_norm``) and ``wkv_b`` column-wise, ``wkv_a`` and ``kv_norm`` replicated, ``wo``
row-wise back to the sequence-sharded stream, the shared rotary key's gradient summed."""

DEEPSEEK_V3_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + LATENT_ATTENTION_RULES + DENSE_FFN_RULES + MOE_RULES,
    ep=MOE_EXPERT_RULES,
    cp=ROPE_CP_RULES,
    description="DeepSeek-V3 (latent attention, MoE)",
)
"""DeepSeek-V3's table: TP for the decoder trunk, :data:`LATENT_ATTENTION_RULES`, the dense
first blocks and the MoE layers; the routed experts over the expert mesh; the RoPE table under
CP."""


def parallelize_deepseek_v3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, EP, AC, compile and FSDP (experts on the ``efsdp`` mesh) to DeepSeek-V3.

    Args:
        model: The DeepSeek-V3 decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.parallelize_deepseekv3`.
    """
    return parallelize_moe_decoder(model, parallel_dims, job_config, sharding=DEEPSEEK_V3_SHARDING)
