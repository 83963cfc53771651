"""DeepSeek-V3 sizes, from the tiny test model to the published 671B."""

from __future__ import annotations

from hp_trainer.models.deepseek_v3.model import DeepSeekV3Args, deepseek_v3_routing

__all__ = ["deepseek_v3_flavors"]

deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    "tiny": DeepSeekV3Args(dim=64, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=2048,
                           ffn_hidden_dim=128, moe_hidden_dim=32, norm_eps=1e-6,
                           rope_theta=10000.0, max_seq_len=512, q_lora_rank=0, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           moe_args=deepseek_v3_routing(8, 2, 1, 2, 1, 2.5)),
    "debugmodel": DeepSeekV3Args(dim=256, n_layers=6, n_dense_layers=1, n_heads=16,
                                 vocab_size=2048, ffn_hidden_dim=1024, moe_hidden_dim=256,
                                 norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096,
                                 q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                                 qk_rope_head_dim=64, v_head_dim=128,
                                 moe_args=deepseek_v3_routing(8, 3, 2, None, None, 1.0)),
    "671B": DeepSeekV3Args(dim=7168, n_layers=61, n_dense_layers=3, n_heads=128,
                           vocab_size=129280, ffn_hidden_dim=18432, moe_hidden_dim=2048,
                           norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096,
                           q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128,
                           moe_args=deepseek_v3_routing(256, 8, 1, 8, 4, 2.5)),
}  # fmt: skip
"""DeepSeek-V3 sizes: ``tiny`` (tests: one dense and one MoE block, 8 experts in 2 groups),
``debugmodel`` (CPU runs) and ``671B`` (the published model at its 4096-token pre-training
context: 61 blocks, 3 dense, 256 routed experts in 8 groups of which 4 are reachable, top 8,
1 shared expert, routed scale 2.5, query rank 1536, KV rank 512). YaRN context extension
(the released checkpoint's ``rope_scaling``) comes with ``--model.flavor auto`` from its
config.json, or as ``rope_scaling=YarnRopeScaling(...)``."""
