"""Qwen 3 dense sizes, from the tiny test model to the published checkpoints."""

from __future__ import annotations

from hp_trainer.models.common.decoder import DecoderArgs

__all__ = ["qwen3_flavors"]


def _qwen3(dim: int, n_layers: int, n_heads: int, ffn: int, tied: bool) -> DecoderArgs:
    """A published Qwen 3 dense size: the settings every one of them shares."""
    return DecoderArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=ffn,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=40960,
        enable_weight_tying=tied,
    )


qwen3_flavors: dict[str, DecoderArgs] = {
    "tiny": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        vocab_size=2048, ffn_hidden_dim=128, qk_norm=True, norm_eps=1e-6,
                        rope_theta=1000000.0, max_seq_len=512),
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32,
                              vocab_size=2048, ffn_hidden_dim=768, qk_norm=True, norm_eps=1e-6,
                              rope_theta=1000000.0, max_seq_len=4096),
    "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 12288, tied=False),
    "14B": _qwen3(5120, 40, 40, 17408, tied=False),
    "32B": _qwen3(5120, 64, 64, 25600, tied=False),
}  # fmt: skip
"""Qwen 3 dense sizes: ``tiny`` (tests), ``debugmodel`` (CPU runs) and the published ``0.6B``
to ``32B`` (head_dim 128, QK-norm, 8 KV heads, RoPE base 1e6, 40960 positions, tied
embeddings up to 4B), as in their ``config.json`` files (checked on HF import)."""
