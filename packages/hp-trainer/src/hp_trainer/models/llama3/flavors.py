"""Llama 3 sizes, from the tiny test model to the published 3.0 / 3.1 / 3.2 checkpoints."""

from __future__ import annotations

from hp_trainer.models.common.decoder import DecoderArgs, RopeScaling

__all__ = ["llama3_flavors"]

_LLAMA31 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32 = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_VOCAB = 128256

llama3_flavors: dict[str, DecoderArgs] = {
    # for unit tests: dim <= 96, 2 blocks
    "tiny": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048,
                        multiple_of=32, rope_theta=10000.0, max_seq_len=512),
    # TorchTitan's debug model: ~6M parameters, trains on CPU
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048,
                              multiple_of=256, rope_theta=500000.0, max_seq_len=2048),
    # Llama 3.0 (8K context, plain RoPE)
    "8B": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB,
                      ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
                      max_seq_len=8192),
    "70B": DecoderArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_VOCAB,
                       ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0,
                       max_seq_len=8192),
    # Llama 3.1 (128K context, llama3 RoPE scaling x8)
    "3.1-8B": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB,
                          ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
                          rope_scaling=_LLAMA31, max_seq_len=131072),
    "3.1-70B": DecoderArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_VOCAB,
                           ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0,
                           rope_scaling=_LLAMA31, max_seq_len=131072),
    "3.1-405B": DecoderArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                            vocab_size=_VOCAB, ffn_dim_multiplier=1.2, multiple_of=4096,
                            rope_theta=500000.0, rope_scaling=_LLAMA31, max_seq_len=131072),
    # Llama 3.2 (128K context, llama3 RoPE scaling x32, tied embeddings)
    "3.2-1B": DecoderArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB,
                          ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0,
                          rope_scaling=_LLAMA32, max_seq_len=131072, enable_weight_tying=True),
    "3.2-3B": DecoderArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=_VOCAB,
                          ffn_dim_multiplier=1.0, multiple_of=256, rope_theta=500000.0,
                          rope_scaling=_LLAMA32, max_seq_len=131072, enable_weight_tying=True),
}  # fmt: skip
llama3_flavors["1B"] = llama3_flavors["3.2-1B"]
"""Llama 3 sizes: ``tiny`` (tests), ``debugmodel`` (CPU runs), the published Llama 3.0
(``8B``, ``70B``), 3.1 (``3.1-8B``, ``3.1-70B``, ``3.1-405B``: RoPE scaling x8) and 3.2
(``3.2-1B`` alias ``1B``, ``3.2-3B``: scaling x32, tied embeddings) models. Their shapes and
RoPE settings are those of the published ``config.json`` files (checked on HF import)."""
