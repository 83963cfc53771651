"""gpt-oss (``GptOssForCausalLM``): attention sinks, alternating sliding-window and full
layers, YaRN, and biased experts with a clamped SwiGLU.

``model`` holds the decoder, its attention, router and experts, ``flavors`` its sizes,
``parallelize`` its sharding table and recipe, ``state_dict_adapter`` and ``hf_config`` its
HuggingFace mapping.

Registers the ``gpt_oss`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.gpt_oss.flavors import gpt_oss_flavors
from hp_trainer.models.gpt_oss.hf_config import gpt_oss_args_from_hf_config
from hp_trainer.models.gpt_oss.model import GptOss, GptOssArgs, GptOssAttention, GptOssExperts
from hp_trainer.models.gpt_oss.parallelize import (
    GPT_OSS_SHARDING,
    gpt_oss_job_error,
    parallelize_gpt_oss,
)
from hp_trainer.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = [
    "GPT_OSS_SHARDING",
    "GptOss",
    "GptOssArgs",
    "GptOssAttention",
    "GptOssExperts",
    "GptOssStateDictAdapter",
    "gpt_oss_flavors",
    "parallelize_gpt_oss",
]

register_model_spec(
    ModelSpec(
        name="gpt_oss",
        flavors=dict(gpt_oss_flavors),
        model_cls=GptOss,
        parallelize_fn=parallelize_gpt_oss,
        state_dict_adapter=GptOssStateDictAdapter,
        pipelining_fn=pipeline_decoder,
        args_from_hf_config=gpt_oss_args_from_hf_config,
        sharding=GPT_OSS_SHARDING,  # TP / EP / CP table (CP: windows and sinks to the engine)
        job_check=gpt_oss_job_error,  # --moe.fused refused
    )
)
