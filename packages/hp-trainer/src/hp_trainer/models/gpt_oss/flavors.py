"""gpt-oss sizes, from the tiny test model to the published ``gpt-oss-20b`` and ``-120b``."""

from __future__ import annotations

from hp_trainer.models.common.decoder import YarnRopeScaling
from hp_trainer.models.gpt_oss.model import GptOssArgs, gpt_oss_routing

__all__ = ["gpt_oss_flavors"]

# gpt-oss's YaRN: 32x the 4096-position pre-training context, no truncation of the ramp
_YARN = YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False)


def _published(n_layers: int, num_experts: int) -> GptOssArgs:
    """A published gpt-oss size (2880 wide, 64 heads of 64, 8 KV heads, top 4 experts)."""
    return GptOssArgs(
        dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088,
        norm_eps=1e-5, rope_theta=150000.0, rope_scaling=_YARN, max_seq_len=131072,
        moe_hidden_dim=2880, moe_args=gpt_oss_routing(num_experts, 4, aux_loss_coeff=0.9),
        sliding_window=128,
    )  # fmt: skip


gpt_oss_flavors: dict[str, GptOssArgs] = {
    # the tiny model: sliding window 8 under a 32-token training sequence, YaRN 8x over 64
    "tiny": GptOssArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       vocab_size=2048, norm_eps=1e-5, rope_theta=150000.0,
                       rope_scaling=YarnRopeScaling(factor=8.0,
                                                    original_max_position_embeddings=64,
                                                    truncate=False),
                       max_seq_len=512, moe_hidden_dim=32, moe_args=gpt_oss_routing(6, 2),
                       sliding_window=8),
    "debugmodel": GptOssArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
                             vocab_size=2048, norm_eps=1e-5, rope_theta=150000.0,
                             rope_scaling=YarnRopeScaling(factor=8.0,
                                                          original_max_position_embeddings=512,
                                                          truncate=False),
                             max_seq_len=4096, moe_hidden_dim=128,
                             moe_args=gpt_oss_routing(8, 2), sliding_window=32),
    "20b": _published(24, 32),
    "120b": _published(36, 128),
}  # fmt: skip
"""gpt-oss sizes: ``tiny`` (tests: 6 experts, top 2, window 8), ``debugmodel`` (CPU runs: 8
experts, window 32) and the published ``20b`` (24 blocks, 32 experts) and ``120b`` (36 blocks,
128 experts): 2880 wide, 64 query heads and 8 KV heads of 64, 4 experts per token, sliding
window 128 on every other block, YaRN 32x over 4096 positions, RoPE base 150000, as in their
``config.json`` files."""
