"""Llama 3 dense decoder: flavors and its parallelize function."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_trainer.hf_adapters import Llama3StateDictAdapter
from hp_trainer.model_spec import ModelSpec, register_model_spec
from hp_trainer.models._common import parallelize_dense_decoder
from hp_trainer.models.decoder import Decoder, DecoderArgs

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.parallel_dims import ParallelDims

__all__ = ["llama3_flavors", "parallelize_llama"]

llama3_flavors: dict[str, DecoderArgs] = {
    # for unit tests: dim <= 96, 2 blocks
    "tiny": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048,
                        multiple_of=32, rope_theta=10000.0, max_seq_len=512),
    # TorchTitan's debug model: ~6M parameters, trains on CPU
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048,
                              multiple_of=256, rope_theta=500000.0, max_seq_len=2048),
    "1B": DecoderArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0,
                      max_seq_len=131072),
    "8B": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
                      max_seq_len=131072),
}  # fmt: skip
"""Llama 3 sizes: ``tiny`` (tests), ``debugmodel`` (CPU runs), ``1B`` and ``8B``."""


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and FSDP/HSDP to a Llama 3 model.

    Args:
        model: The Llama 3 decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    See Also:
        ``torchtitan.models.llama3.infra.parallelize.parallelize_llama``.
    """
    return parallelize_dense_decoder(model, parallel_dims, job_config)


register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=dict(llama3_flavors),
        model_cls=Decoder,
        parallelize_fn=parallelize_llama,
        state_dict_adapter=Llama3StateDictAdapter,
    )
)
