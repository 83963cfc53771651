"""Qwen3.5 sizes: the tiny test models, the CPU debug models and HF's reference sizes."""

from __future__ import annotations

from typing import Any

from hp_trainer.models.qwen3_5.model import (
    Qwen35Args,
    Qwen35MoeArgs,
    hybrid_layer_types,
    qwen3_5_moe_routing,
)

__all__ = ["qwen3_5_flavors", "qwen3_5_moe_flavors"]

# tiny: one Gated DeltaNet block then one full-attention block (tests: dim <= 96, 2 blocks)
_TINY: dict[str, Any] = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=2048, norm_eps=1e-6,
    max_seq_len=512, layer_types=hybrid_layer_types(2, 2), linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_chunk_size=8,
)  # fmt: skip
# debugmodel: three Gated DeltaNet blocks, then full attention (HF's 3:1 schedule)
_DEBUG: dict[str, Any] = dict(
    dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, norm_eps=1e-6,
    max_seq_len=4096, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32,
)  # fmt: skip
# transformers 5.25's configuration defaults (Qwen3_5TextConfig: "Qwen3.5-9B style";
# Qwen3_5MoeTextConfig: "Qwen3.5-35B-A3B style"); a published checkpoint's own config.json
# (with --model.flavor auto) is the authority for its RoPE base and context length
_HF_COMMON: dict[str, Any] = dict(n_kv_heads=None, head_dim=256, vocab_size=248320, norm_eps=1e-6,
                  rope_theta=10000.0, max_seq_len=32768, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128)  # fmt: skip

qwen3_5_flavors: dict[str, Qwen35Args] = {
    "tiny": Qwen35Args(**_TINY, ffn_hidden_dim=128),
    "debugmodel": Qwen35Args(**_DEBUG, ffn_hidden_dim=384),
    "9B": Qwen35Args(**{**_HF_COMMON, "n_kv_heads": 4}, dim=4096, n_layers=32, n_heads=16,
                     ffn_hidden_dim=12288),
}  # fmt: skip
"""Qwen3.5 dense sizes: ``tiny`` (tests: one Gated DeltaNet and one full-attention block),
``debugmodel`` (CPU runs: three Gated DeltaNet blocks then full attention) and ``9B``
(``transformers``' ``Qwen3_5TextConfig`` defaults: 32 blocks, 3 linear to 1 full, 16 heads
of 256 with 4 KV heads, a quarter of each head rotated, 16 key / 32 value heads of 128 in
the Gated DeltaNet blocks)."""

qwen3_5_moe_flavors: dict[str, Qwen35MoeArgs] = {
    "tiny": Qwen35MoeArgs(**_TINY, moe_hidden_dim=32,
                          shared_expert_hidden_dim=48, moe_args=qwen3_5_moe_routing(8, 2)),
    "debugmodel": Qwen35MoeArgs(**_DEBUG, moe_hidden_dim=128,
                                shared_expert_hidden_dim=128,
                                moe_args=qwen3_5_moe_routing(8, 2)),
    "35B-A3B": Qwen35MoeArgs(**{**_HF_COMMON, "n_kv_heads": 2},
                             dim=2048, n_layers=40, n_heads=16,
                             moe_hidden_dim=512, shared_expert_hidden_dim=512,
                             moe_args=qwen3_5_moe_routing(256, 8)),
}  # fmt: skip
"""Qwen3.5 MoE sizes: ``tiny`` and ``debugmodel`` as the dense ones with 8 experts (top 2)
and a gated shared expert, and ``35B-A3B`` (``transformers``' ``Qwen3_5MoeTextConfig``
defaults: 40 blocks, 256 experts of 512, 8 per token, a shared expert of 512)."""
