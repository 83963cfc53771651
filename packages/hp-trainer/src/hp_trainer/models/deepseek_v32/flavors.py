"""DeepSeek-V3.2 sizes, from the tiny test model to the published 671B."""

from __future__ import annotations

from hp_trainer.models.common.decoder import YarnRopeScaling
from hp_trainer.models.deepseek_v3.model import deepseek_v3_routing
from hp_trainer.models.deepseek_v32.model import DeepSeekV32Args

__all__ = ["deepseek_v32_flavors"]

deepseek_v32_flavors: dict[str, DeepSeekV32Args] = {
    "tiny": DeepSeekV32Args(dim=64, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=2048,
                            ffn_hidden_dim=128, moe_hidden_dim=32, norm_eps=1e-6,
                            rope_theta=10000.0, max_seq_len=512, q_lora_rank=32,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=8,
                            moe_args=deepseek_v3_routing(8, 2, 1, 2, 1, 2.5)),
    "debugmodel": DeepSeekV32Args(dim=256, n_layers=4, n_dense_layers=1, n_heads=8,
                                  vocab_size=2048, ffn_hidden_dim=512, moe_hidden_dim=128,
                                  norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096,
                                  q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                                  qk_rope_head_dim=16, v_head_dim=32, index_n_heads=8,
                                  index_head_dim=32, index_topk=32,
                                  moe_args=deepseek_v3_routing(8, 2, 1, None, None, 1.0)),
    "671B": DeepSeekV32Args(dim=7168, n_layers=61, n_dense_layers=3, n_heads=128,
                            vocab_size=129280, ffn_hidden_dim=18432, moe_hidden_dim=2048,
                            norm_eps=1e-6, rope_theta=10000.0, max_seq_len=163840,
                            rope_scaling=YarnRopeScaling(factor=40.0,
                                                         original_max_position_embeddings=4096,
                                                         beta_fast=32.0, beta_slow=1.0,
                                                         mscale=1.0, mscale_all_dim=1.0),
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
                            index_head_dim=128, index_topk=2048,
                            moe_args=deepseek_v3_routing(256, 8, 1, 8, 4, 2.5)),
}  # fmt: skip
"""DeepSeek-V3.2 sizes: ``tiny`` (tests: one dense and one MoE block, 8 indexer heads of 16,
top 8), ``debugmodel`` (CPU runs: 4 blocks, 8 indexer heads of 32, top 32 of a 128-token
context) and ``671B`` (the published DeepSeek-V3.2 at its 128K context: DeepSeek-V3's 671B
trunk with YaRN factor 40 over 4096 positions, and an indexer of 64 heads of 128 selecting
2048 tokens per query)."""
