"""DeepSeek-V3's parallelize function and the TP plan of its latent attention (heads split,
latent shared); the rest of the model follows the shared MoE plan
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
    RowwiseParallel,
)
from hp_trainer._parallel_api import parallelize_module as tp_parallelize_module
from hp_trainer.models.common.expert_parallel import parallelize_moe_decoder
from hp_trainer.models.deepseek_v3.model import MLAttention

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["apply_tp_to_latent_attention", "parallelize_deepseek_v3"]


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


def apply_tp_to_latent_attention(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard one :class:`~hp_trainer.models.deepseek_v3.MLAttention` over its heads.

    The sequence-sharded input is gathered and handed to the attention as a local tensor; the
    query projection (``wq``, or ``wq_b`` after the replicated ``wq_a``/``q_norm``) and the
    latent's up-projection ``wkv_b`` are column-wise (each rank computes ``n_heads // tp``
    heads, which the attention reads from the projections' widths); the latent projection
    ``wkv_a`` and ``kv_norm`` are replicated (:class:`hp_tp.NoParallel`: the latent and the
    rotary key are shared by all heads); ``wo`` is row-wise back to the sequence-sharded stream.

    Args:
        attention: The block's latent attention module.
        tp_mesh: 1-D tensor-parallel mesh.

    Raises:
        TypeError: If ``attention`` is not an :class:`~hp_trainer.models.deepseek_v3.MLAttention`.
        ValueError: If the TP degree does not divide the attention's head count.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.apply_non_moe_tp` (its
        attention plan).
    """
    if not isinstance(attention, MLAttention):
        raise TypeError(f"expected an MLAttention, got {type(attention).__name__}")
    tp = tp_mesh.size()
    n_heads = attention.n_heads
    if n_heads % tp != 0:
        raise ValueError(f"tensor parallel degree {tp} must divide the attention's {n_heads} heads")
    plan: dict[str, ParallelStyle] = {
        "wkv_a": NoParallel(),
        "kv_norm": NoParallel(),
        "wkv_b": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if getattr(attention, "wq", None) is not None:
        plan["wq"] = ColwiseParallel()
    else:
        plan.update({"wq_a": NoParallel(), "q_norm": NoParallel(), "wq_b": ColwiseParallel()})
    tp_parallelize_module(attention, tp_mesh, plan)
    _sum_rotary_key_gradient(attention, tp_mesh)


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
    return parallelize_moe_decoder(
        model, parallel_dims, job_config, attention_tp=apply_tp_to_latent_attention
    )
