"""Qwen 3 MoE (``Qwen3MoeForCausalLM`` layout): flavors, model builder and parallelize function.

Every block is an MoE block: grouped-query attention with per-head QK-norm (as dense Qwen 3),
then a softmax top-k router over ``num_experts`` SwiGLU experts whose top-k weights are
renormalized (``norm_topk_prob``) and applied to the experts' outputs; no shared experts and no
routing bias, so an exported checkpoint computes exactly what ``transformers`` computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_cp_ep import MoEArgs
from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.hf_moe_adapters import Qwen3MoeStateDictAdapter
from hp_trainer.model_spec import ModelSpec, register_model_spec
from hp_trainer.models._moe_block import MoEDecoder, MoEDecoderArgs
from hp_trainer.models.decoder import Attention

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.parallel_dims import ParallelDims

__all__ = ["Qwen3MoE", "parallelize_qwen3_moe", "qwen3_moe_flavors"]


def _qwen3_moe_routing(num_experts: int, top_k: int) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        top_k=top_k,
        load_balance_coeff=None,
    )


def _published(dim: int, n_layers: int, n_heads: int, moe_hidden: int, ffn: int) -> MoEDecoderArgs:
    """A published Qwen 3 MoE size (128 experts, top 8, head_dim 128, 4 KV heads)."""
    return MoEDecoderArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
        vocab_size=151936, ffn_hidden_dim=ffn, qk_norm=True, norm_eps=1e-6,
        rope_theta=1000000.0, max_seq_len=40960, moe_hidden_dim=moe_hidden,
        moe_args=_qwen3_moe_routing(128, 8),
    )  # fmt: skip


qwen3_moe_flavors: dict[str, MoEDecoderArgs] = {
    "tiny": MoEDecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           vocab_size=2048, ffn_hidden_dim=128, qk_norm=True, norm_eps=1e-6,
                           rope_theta=1000000.0, max_seq_len=512, moe_hidden_dim=32,
                           moe_args=_qwen3_moe_routing(8, 2)),
    "debugmodel": MoEDecoderArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
                                 vocab_size=2048, ffn_hidden_dim=384, qk_norm=True,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=4096,
                                 moe_hidden_dim=128, moe_args=_qwen3_moe_routing(8, 2)),
    "30B-A3B": _published(2048, 48, 32, 768, 6144),
    "235B-A22B": _published(4096, 94, 64, 1536, 12288),
}  # fmt: skip
"""Qwen 3 MoE sizes: ``tiny`` (tests), ``debugmodel`` (CPU runs) and the published
``30B-A3B`` and ``235B-A22B`` (128 experts, 8 per token, softmax routing renormalized over the
top 8, QK-norm, 4 KV heads of 128, RoPE base 1e6), as in their ``config.json`` files."""


class Qwen3MoE(MoEDecoder):
    """The Qwen 3 MoE decoder: QK-normed grouped-query attention and MoE feed-forwards.

    Args:
        args: Model arguments (a :data:`qwen3_moe_flavors` entry).

    See Also:
        :titan:`torchtitan.models.qwen3` (its MoE flavors); ``transformers.Qwen3MoeForCausalLM``.
    """

    def __init__(self, args: MoEDecoderArgs) -> None:
        assert args.head_dim is not None
        super().__init__(args, Attention, rope_dim=args.head_dim)


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
    from hp_trainer.distributed.expert_parallel import parallelize_moe_decoder

    return parallelize_moe_decoder(model, parallel_dims, job_config)


register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        flavors=dict(qwen3_moe_flavors),
        model_cls=Qwen3MoE,
        parallelize_fn=parallelize_qwen3_moe,
        state_dict_adapter=Qwen3MoeStateDictAdapter,
        pipelining_fn=pipeline_decoder,
        extra={"context_parallel": True},  # SDPA attention, rope_cache indexed by position
    )
)
