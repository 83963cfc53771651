"""Llama 4 sizes, from the tiny test model to the published Scout and Maverick."""

from __future__ import annotations

from hp_trainer.models.common.decoder import RopeScaling
from hp_trainer.models.llama4.model import Llama4Args, llama4_routing

__all__ = ["llama4_flavors"]


def _published(
    experts: int, step: int, qk_norm: bool, max_seq_len: int, scaling: RopeScaling | None
) -> Llama4Args:
    """A published Llama 4 text model: 48 blocks of 5120, 40 heads of 128, 8 KV heads, top 1."""
    return Llama4Args(
        dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128, vocab_size=202048,
        ffn_hidden_dim=16384, moe_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=scaling, max_seq_len=max_seq_len, qk_norm=qk_norm,
        moe_args=llama4_routing(experts, 1), interleave_moe_layer_step=step,
        no_rope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True,
        floor_scale=8192.0, attn_scale=0.1,
    )  # fmt: skip


_SCOUT = _published(
    16, 1, True, 10485760,
    RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                original_max_position_embeddings=8192),
)  # fmt: skip
_MAVERICK = _published(128, 2, False, 1048576, None)

llama4_flavors: dict[str, Llama4Args] = {
    # three blocks: dense RoPE (chunked), MoE RoPE (chunked), dense NoPE (temperature-tuned
    # from position 7 on: floor_scale 8, so the tests see it)
    "tiny": Llama4Args(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                       vocab_size=2048, ffn_hidden_dim=128, moe_hidden_dim=32, norm_eps=1e-5,
                       rope_theta=500000.0, max_seq_len=512, qk_norm=True,
                       moe_args=llama4_routing(8, 1), interleave_moe_layer_step=2,
                       no_rope_layer_interval=3, attention_chunk_size=8,
                       attn_temperature_tuning=True, floor_scale=8.0, attn_scale=0.1),
    "debugmodel": Llama4Args(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
                             vocab_size=2048, ffn_hidden_dim=384, moe_hidden_dim=128,
                             norm_eps=1e-5, rope_theta=500000.0, max_seq_len=4096,
                             qk_norm=True, moe_args=llama4_routing(8, 1),
                             interleave_moe_layer_step=2, no_rope_layer_interval=4,
                             attention_chunk_size=32, attn_temperature_tuning=True,
                             floor_scale=32.0, attn_scale=0.1),
    "Scout-17B-16E": _SCOUT,
    "Maverick-17B-128E": _MAVERICK,
    "17bx16e": _SCOUT,  # TorchTitan's names
    "17bx128e": _MAVERICK,
}  # fmt: skip
"""Llama 4 sizes, ``tiny`` (tests, dense/MoE/dense, the last a NoPE block, chunks of 8),
``debugmodel`` (CPU runs: 4 blocks, MoE every 2nd, NoPE every 4th, chunks of 32) and the
published ``Scout-17B-16E`` (16 experts in every block, QK-norm, RoPE scaled by 16 from an
8192-token context, 10M positions) and ``Maverick-17B-128E`` (128 experts in every 2nd block,
no QK-norm, no RoPE scaling, 1M positions), both top 1 with one shared expert, NoPE every 4th
block, chunks of 8192, as in their ``config.json`` files; ``17bx16e`` / ``17bx128e`` are the
same under TorchTitan's names."""
