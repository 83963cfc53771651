"""Qwen3.5's sharding tables and ``parallelize_qwen3_5`` (HyperParallel's name): TP, EP, FSDP.

Tensor parallelism splits heads in both kinds of block. Gated attention is the grouped-query
plan (``wq`` holds each head's query and gate side by side, so a column shard keeps them
together). In a Gated DeltaNet block the query, key, value, output-gate, ``beta`` and decay
projections are column-wise (whole key heads and the value heads they serve on each rank:
value head ``j`` reads key head ``j // group``, and both split into contiguous ranges), the
depthwise conv kernels and the per-head ``dt_bias`` / ``A_log`` are sharded on the same
channels and heads (dimension 0), the gated RMSNorm (one scale shared by the heads) runs
sequence-parallel on the head axis, and ``wo`` is row-wise back to the sequence-sharded
residual stream.

Context parallelism is refused: each Gated DeltaNet block carries a state through the whole
sequence, so a rank holding a later part of it would need the state left by the ranks before
it (passed along the ring, one chunk after another), which this recipe does not implement.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from hp_trainer.models.common.parallelize import parallelize_dense_decoder
from hp_trainer.models.common.tensor_parallel import (
    DENSE_FFN_RULES,
    GQA_ATTENTION_RULES,
    TRUNK_RULES,
)
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "CONTEXT_PARALLEL_REFUSAL",
    "GATED_DELTANET_RULES",
    "QWEN3_5_MOE_SHARDING",
    "QWEN3_5_SHARDING",
    "ShardOwnParameters",
    "parallelize_qwen3_5",
    "qwen3_5_job_error",
    "qwen3_5_layout_error",
]

CONTEXT_PARALLEL_REFUSAL = (
    "Qwen3.5's Gated DeltaNet (linear-attention) blocks carry a recurrent state through the "
    "whole sequence: under context parallelism each rank would need the state left by the "
    "ranks holding the earlier parts (passed along the ring), which hp-trainer does not "
    "implement; use context_parallel_degree = 1"
)
"""Why ``context_parallel_degree > 1`` is refused for Qwen3.5 (at parse time)."""

_SEQ = Shard(1)
_HEADS = 2  # (B, S, heads, head_dim) at the gated RMSNorm


class ShardOwnParameters(ParallelStyle):
    """Shard some of a module's own parameters on dimension 0 (heads or channels).

    The module reads them with ``to_local()`` (so their gradients stay sharded), next to
    column-sharded projections whose output channels are laid out the same way.

    Args:
        names: The parameters (direct attributes of the module).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = dict(module.named_parameters(recurse=False))
        missing = [n for n in self.names if n not in own]
        if missing:
            raise ValueError(
                f"ShardOwnParameters: {type(module).__name__} has no parameters {missing}; "
                f"its own are {sorted(own)}"
            )
        for name in self.names:
            param = own[name]
            sharded = distribute_tensor(
                param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        return module


_LINEAR_SHARDED_PARAMS = ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")

GATED_DELTANET_RULES = (
    ShardingRule(
        "layers.*.linear_attention",
        lambda o: ComposedStyle(
            PrepareModuleInput(input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),)),
            ShardOwnParameters(_LINEAR_SHARDED_PARAMS),
        ),
    ),
    *(
        ShardingRule(f"layers.*.linear_attention.{name}", lambda o: ColwiseParallel())
        for name in ("wq", "wk", "wv", "wz", "wb", "wa")
    ),
    ShardingRule(
        "layers.*.linear_attention.norm",
        lambda o: SequenceParallel(sequence_dim=_HEADS, use_local_output=True),
    ),
    ShardingRule("layers.*.linear_attention.wo", lambda o: RowwiseParallel(output_layouts=_SEQ)),
)
"""The Gated DeltaNet block under TP: heads split, the conv and decays sharded alike."""

_SHARED_EXPERT_RULES = (
    # the MoE sees every token on each TP rank (MOE_RULES): the shared expert is replicated
    ShardingRule("layers.*.moe.shared_expert", lambda o: NoParallel()),
    ShardingRule("layers.*.moe.shared_expert_gate", lambda o: NoParallel()),
)

QWEN3_5_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + GQA_ATTENTION_RULES + GATED_DELTANET_RULES + DENSE_FFN_RULES,
    description="Qwen3.5 (Gated DeltaNet / gated attention hybrid)",
)
"""The dense Qwen3.5 table: TP with sequence parallel; no CP section (refused)."""

QWEN3_5_MOE_SHARDING = ShardingConfig(
    tp=TRUNK_RULES
    + GQA_ATTENTION_RULES
    + GATED_DELTANET_RULES
    + DENSE_FFN_RULES
    + _SHARED_EXPERT_RULES
    + MOE_RULES,
    ep=MOE_EXPERT_RULES,
    description="Qwen3.5 MoE (Gated DeltaNet / gated attention hybrid, gated shared expert)",
)
"""The Qwen3.5 MoE table: the dense one, the MoE layers (tokens replicated over TP, router and
shared expert replicated) and the routed experts over the expert mesh."""


def qwen3_5_job_error(config: JobConfig) -> tuple[str, str, object, str] | None:
    """The first job option a Qwen3.5 model cannot train with (``ModelSpec.job_check``).

    ``compile.enable``: the backward of a compiled Gated DeltaNet block fails in torch 2.13
    (a view of a non-contiguous gradient); the full-attention blocks compile, the hybrid
    model does not yet.

    Args:
        config: The job configuration.

    Returns:
        ``(section, field, value, expected)`` of the first problem, else None.
    """
    if config.compile.enable:
        return ("compile", "enable", True, f"false with model.name = {config.model.name!r}: "
                "a compiled Gated DeltaNet block's backward fails in torch 2.13")  # fmt: skip
    return None


def qwen3_5_layout_error(parallel_dims: ParallelDims, model_args: object) -> str | None:
    """Why this layout cannot train this Qwen3.5 model, or None when it can.

    Args:
        parallel_dims: The degrees.
        model_args: The model's :class:`~hp_trainer.models.qwen3_5.model.Qwen35Args`.

    Returns:
        A message naming the values, or None.
    """
    dims = parallel_dims
    if dims.cp > 1:
        return f"context_parallel_degree = {dims.cp}: " + CONTEXT_PARALLEL_REFUSAL
    if dims.tp > 1:
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            heads = int(getattr(model_args, name))
            if heads % dims.tp:
                return (
                    f"tensor_parallel_degree = {dims.tp} must divide the Gated DeltaNet "
                    f"blocks' {name} = {heads}"
                )
    return None


def parallelize_qwen3_5(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, EP (MoE flavor), AC, compile and FSDP/HSDP to a Qwen3.5 model.

    The sharding table (``QWEN3_5_SHARDING``, or ``QWEN3_5_MOE_SHARDING`` with routed experts,
    in ``hp_trainer.models.qwen3_5.parallelize``) goes to the recipe the dense and MoE decoders
    share: TP (heads of both attention kinds; the Gated DeltaNet's conv kernels and decays
    sharded with them), EP (``ExpertParallel`` / ``ExpertTensorParallel`` /
    ``TensorParallel`` for the routed experts), activation checkpointing, compile, FSDP.

    Args:
        model: A :class:`~hp_trainer.Qwen35` (or a pipeline stage).
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    Raises:
        ValueError: Context parallelism (the Gated DeltaNet state would have to pass along the
            ring; refused, also up front by the layout check), or a TP degree
            not dividing a head count.

    See Also:
        HyperParallel's ``parallelize_qwen3_5``;
        :titan:`torchtitan.models.qwen3.infra.parallelize.parallelize_qwen3`.
    """
    args = model.args
    problem = qwen3_5_layout_error(parallel_dims, args)
    if problem is not None:
        raise ValueError(problem)
    if getattr(args, "moe_args", None) is not None:
        return parallelize_moe_decoder(
            model, parallel_dims, job_config, sharding=QWEN3_5_MOE_SHARDING
        )
    return parallelize_dense_decoder(model, parallel_dims, job_config, sharding=QWEN3_5_SHARDING)
