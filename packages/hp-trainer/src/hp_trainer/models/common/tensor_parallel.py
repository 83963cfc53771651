"""The tensor (and sequence) parallel tables of the decoders: trunk, attention, dense MLP."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from hp_trainer._parallel_api import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from hp_trainer.distributed.sharding import apply_sharding
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

__all__ = [
    "DENSE_DECODER_SHARDING",
    "DENSE_FFN_RULES",
    "GQA_ATTENTION_RULES",
    "ROPE_CP_RULES",
    "TRUNK_RULES",
    "TRUNK_SHARDING",
    "apply_tp",
    "apply_tp_to_trunk",
    "check_tp_degree",
]

_SEQ = Shard(1)
_HEADS = 2  # queries/keys are (B, S, local_heads, head_dim) at the QK-norms

TRUNK_RULES = (
    # embedding row-wise, its output sharded on the sequence; final norm sequence parallel
    ShardingRule(
        "tok_embeddings",
        lambda o: RowwiseParallel(input_layouts=Replicate(), output_layouts=_SEQ),
    ),
    ShardingRule("norm", lambda o: SequenceParallel()),
    # LM head column-wise: vocab-sharded logits for the parallel loss, else replicated
    ShardingRule(
        "lm_head",
        lambda o: ColwiseParallel(
            input_layouts=_SEQ,
            output_layouts=Shard(-1) if o["loss_parallel"] else Replicate(),
            use_local_output=not o["loss_parallel"],
        ),
    ),
)

TRUNK_SHARDING = ShardingConfig(tp=TRUNK_RULES, description="decoder embedding, norm, LM head")
"""The embedding, final norm and LM head of every decoder (dense and MoE)."""

GQA_ATTENTION_RULES = (
    ShardingRule("layers.*.attention_norm", lambda o: SequenceParallel()),
    ShardingRule(
        "layers.*.attention",
        lambda o: PrepareModuleInput(
            input_layouts=(_SEQ, None), desired_input_layouts=(Replicate(), None)
        ),
    ),
    ShardingRule("layers.*.attention.wq", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wk", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wv", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.attention.wo", lambda o: RowwiseParallel(output_layouts=_SEQ)),
    ShardingRule(
        "layers.*.attention.q_norm",
        lambda o: SequenceParallel(sequence_dim=_HEADS, use_local_output=True),
    ),
    ShardingRule(
        "layers.*.attention.k_norm",
        lambda o: SequenceParallel(sequence_dim=_HEADS, use_local_output=True),
    ),
)
"""Grouped-query attention (and its optional per-head QK-norms) of every block."""

DENSE_FFN_RULES = (
    ShardingRule("layers.*.ffn_norm", lambda o: SequenceParallel()),
    ShardingRule(
        "layers.*.feed_forward",
        lambda o: PrepareModuleInput(input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),)),
    ),
    ShardingRule("layers.*.feed_forward.w1", lambda o: ColwiseParallel()),
    ShardingRule("layers.*.feed_forward.w2", lambda o: RowwiseParallel(output_layouts=_SEQ)),
    ShardingRule("layers.*.feed_forward.w3", lambda o: ColwiseParallel()),
)
"""The SwiGLU feed-forward of every dense block."""

ROPE_CP_RULES = (ShardingRule("rope_cache", lambda o: Shard(0)),)
"""Context parallel: the RoPE table (one row per position) is sharded along the sequence with
the inputs, every step; the attention itself runs through SDPA, which the step routes to the
context-parallel engine."""

DENSE_DECODER_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + GQA_ATTENTION_RULES + DENSE_FFN_RULES,
    cp=ROPE_CP_RULES,
    description="dense decoder (Llama 3, Qwen 3)",
)
"""Megatron-style TP with sequence parallel for the dense decoder: norms sequence parallel,
attention and MLP inputs gathered, ``wq``/``wk``/``wv``/``w1``/``w3`` column-wise,
``wo``/``w2`` row-wise back to sequence-sharded, QK-norms sharded on the head axis; under CP
the RoPE table (:data:`ROPE_CP_RULES`)."""


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    enable_float8_tensorwise_tp: bool = False,
    enable_async_tp: bool = False,
) -> None:
    """Shard a :class:`~hp_trainer.models.common.decoder.Decoder` Megatron-style, with SP.

    Embedding: row-wise (output sharded on the sequence); norms: sequence parallel; attention
    and MLP inputs gathered to replicated, ``wq``/``wk``/``wv``/``w1``/``w3`` column-wise,
    ``wo``/``w2`` row-wise back to sequence-sharded; per-head QK-norms sharded on the head axis;
    LM head column-wise, leaving vocab-sharded logits for the parallel loss when
    ``loss_parallel`` (else replicated logits).

    Args:
        model: The decoder (``tok_embeddings``, ``layers``, ``norm``, ``lm_head``).
        tp_mesh: 1-D tensor-parallel mesh.
        loss_parallel: Keep the logits sharded on the vocabulary.
        enable_float8_tensorwise_tp: Float8 TP styles (not available: raises if True).
        enable_async_tp: Async TP with symmetric memory (not available: raises if True).

    Raises:
        ValueError: If a head count is not divisible by the TP degree, or an unavailable
            option is requested.

    See Also:
        :titan:`torchtitan.models.llama3.infra.parallelize.apply_tp`: TorchTitan's TP plan.
    """
    check_tp_degree(
        model,
        tp_mesh,
        enable_float8_tensorwise_tp=enable_float8_tensorwise_tp,
        enable_async_tp=enable_async_tp,
    )
    apply_sharding(model, DENSE_DECODER_SHARDING, tp_mesh, loss_parallel=loss_parallel)


def apply_tp_to_trunk(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Check the head counts, then shard the decoder's embedding, final norm and LM head.

    The part every decoder plan (dense and MoE) shares: embedding row-wise with its output
    sharded on the sequence, the final norm sequence parallel, the LM head column-wise (logits
    vocab-sharded when ``loss_parallel``). A pipeline stage shards the parts it holds.

    Raises:
        ValueError: If a head count is not divisible by the TP degree, or the embedding and LM
            head are tied.

    See Also:
        :titan:`torchtitan.models.llama3.infra.parallelize.apply_tp`: the same top-level plan.
    """
    check_tp_degree(model, tp_mesh)
    apply_sharding(model, TRUNK_SHARDING, tp_mesh, loss_parallel=loss_parallel)


def check_tp_degree(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    enable_float8_tensorwise_tp: bool = False,
    enable_async_tp: bool = False,
) -> None:
    """Refuse a TP degree that does not divide the head counts, tied embeddings, and options
    hp-trainer's TP does not have.

    Args:
        model: The decoder (or a stage of it).
        tp_mesh: 1-D tensor-parallel mesh.
        enable_float8_tensorwise_tp: Keyword-only; float8 TP styles (refused when True).
        enable_async_tp: Keyword-only; async TP (refused when True).

    Raises:
        ValueError: If a head count is not divisible by the TP degree, the embedding and LM
            head are tied, or an unavailable option is requested.
    """
    if enable_float8_tensorwise_tp:
        raise ValueError("float8 tensor parallelism is not available in hp-trainer 0.1")
    if enable_async_tp:
        raise ValueError(
            "async tensor parallelism needs symmetric memory on a CUDA device; it is not "
            "available in hp-trainer 0.1"
        )
    tp = tp_mesh.size()
    args = getattr(model, "args", None)
    if args is not None:
        for name in ("n_heads", "n_kv_heads"):
            if getattr(args, name) % tp != 0:
                raise ValueError(
                    f"tensor parallel degree {tp} must divide model {name} = {getattr(args, name)}"
                )
    if getattr(model, "enable_weight_tying", False):
        raise ValueError(
            "tensor parallelism with tied embeddings is not supported: the embedding is sharded "
            "row-wise and the LM head column-wise; set enable_weight_tying=False or tp=1"
        )
