"""Qwen 3 MoE sizes, from the tiny test model to the published checkpoints."""

from __future__ import annotations

from hp_trainer.models.common.moe_decoder import MoEDecoderArgs
from hp_trainer.models.qwen3_moe.model import qwen3_moe_routing

__all__ = ["qwen3_moe_flavors"]


def _published(dim: int, n_layers: int, n_heads: int, moe_hidden: int, ffn: int) -> MoEDecoderArgs:
    """A published Qwen 3 MoE size (128 experts, top 8, head_dim 128, 4 KV heads)."""
    return MoEDecoderArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
        vocab_size=151936, ffn_hidden_dim=ffn, qk_norm=True, norm_eps=1e-6,
        rope_theta=1000000.0, max_seq_len=40960, moe_hidden_dim=moe_hidden,
        moe_args=qwen3_moe_routing(128, 8),
    )  # fmt: skip


qwen3_moe_flavors: dict[str, MoEDecoderArgs] = {
    "tiny": MoEDecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           vocab_size=2048, ffn_hidden_dim=128, qk_norm=True, norm_eps=1e-6,
                           rope_theta=1000000.0, max_seq_len=512, moe_hidden_dim=32,
                           moe_args=qwen3_moe_routing(8, 2)),
    "debugmodel": MoEDecoderArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
                                 vocab_size=2048, ffn_hidden_dim=384, qk_norm=True,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=4096,
                                 moe_hidden_dim=128, moe_args=qwen3_moe_routing(8, 2)),
    "30B-A3B": _published(2048, 48, 32, 768, 6144),
    "235B-A22B": _published(4096, 94, 64, 1536, 12288),
}  # fmt: skip
"""Qwen 3 MoE sizes: ``tiny`` (tests), ``debugmodel`` (CPU runs) and the published
``30B-A3B`` and ``235B-A22B`` (128 experts, 8 per token, softmax routing renormalized over the
top 8, QK-norm, 4 KV heads of 128, RoPE base 1e6), as in their ``config.json`` files."""
