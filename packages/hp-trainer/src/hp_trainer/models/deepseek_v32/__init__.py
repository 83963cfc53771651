"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 with DeepSeek Sparse Attention.

``model`` holds the lightning indexer, the sparse latent attention and the indexer's KL loss,
``flavors`` its sizes, ``parallelize`` its recipe, sharding table and the indexer's training
stages, ``state_dict_adapter`` and ``hf_config`` its HuggingFace mapping, ``checks`` the
parse-time checks. The scoring, top-k and sparse attention are ``hp_cp_ep.dsa``'s.

Registers the ``deepseek_v32`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.deepseek_v32.checks import dsa_job_error
from hp_trainer.models.deepseek_v32.flavors import deepseek_v32_flavors
from hp_trainer.models.deepseek_v32.hf_config import deepseek_v32_args_from_hf_config
from hp_trainer.models.deepseek_v32.model import (
    DeepSeekV32,
    DeepSeekV32Args,
    DSAttention,
    LightningIndexer,
    indexer_kl_divergence,
)
from hp_trainer.models.deepseek_v32.parallelize import (
    DEEPSEEK_V32_SHARDING,
    configure_indexer_training,
    parallelize_deepseek_v32,
)
from hp_trainer.models.deepseek_v32.state_dict_adapter import DeepSeekV32StateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = [
    "DSAttention",
    "DeepSeekV32",
    "DeepSeekV32Args",
    "DeepSeekV32StateDictAdapter",
    "LightningIndexer",
    "configure_indexer_training",
    "deepseek_v32_flavors",
    "indexer_kl_divergence",
    "parallelize_deepseek_v32",
]

register_model_spec(
    ModelSpec(
        name="deepseek_v32",
        flavors=dict(deepseek_v32_flavors),
        model_cls=DeepSeekV32,
        parallelize_fn=parallelize_deepseek_v32,
        state_dict_adapter=DeepSeekV32StateDictAdapter,
        pipelining_fn=pipeline_decoder,
        args_from_hf_config=deepseek_v32_args_from_hf_config,
        sharding=DEEPSEEK_V32_SHARDING,  # TP / EP / CP (RoPE table; DSA styles) table
        job_check=dsa_job_error,  # called by JobConfig when the job is parsed
    )
)
