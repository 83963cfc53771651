"""Qwen 3 dense decoder (per-head QK-norm): flavors and its parallelize function."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.hf_adapters import Qwen3StateDictAdapter
from hp_trainer.model_spec import ModelSpec, register_model_spec
from hp_trainer.models._common import parallelize_dense_decoder
from hp_trainer.models.decoder import Decoder, DecoderArgs

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.parallel_dims import ParallelDims

__all__ = ["parallelize_qwen3", "qwen3_flavors"]


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


def parallelize_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP (incl. head-sharded QK-norm), AC, compile and FSDP/HSDP to a Qwen 3 model.

    Args:
        model: The Qwen 3 decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        :titan:`torchtitan.models.qwen3.infra.parallelize.parallelize_qwen3`.
    """
    return parallelize_dense_decoder(model, parallel_dims, job_config)


register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=dict(qwen3_flavors),
        model_cls=Decoder,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_decoder,
        extra={"context_parallel": True},  # SDPA attention, rope_cache indexed by position
        state_dict_adapter=Qwen3StateDictAdapter,
    )
)
