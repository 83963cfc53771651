"""Tensor (and sequence) parallelism plan for the dense decoder."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from hp_trainer._parallel_api import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tp"]


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
    if enable_float8_tensorwise_tp:
        raise ValueError("float8 tensor parallelism is not available in hp-trainer 0.1")
    if enable_async_tp:
        raise ValueError(
            "async tensor parallelism needs symmetric memory on a CUDA device; it is not "
            "available in hp-trainer 0.1"
        )
    apply_tp_to_trunk(model, tp_mesh, loss_parallel)
    layers = model.get_submodule("layers")
    for block in layers.children():
        plan: dict[str, ParallelStyle] = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        attention = block.get_submodule("attention")
        if getattr(attention, "q_norm", None) is not None:
            # queries/keys are (B, S, local_heads, head_dim): the heads axis (2) is sharded.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


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
    top_plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # a pipeline stage holds some of the top-level parts (the others are None)
    top_plan = {
        name: style for name, style in top_plan.items() if getattr(model, name, None) is not None
    }
    parallelize_module(model, tp_mesh, top_plan)
