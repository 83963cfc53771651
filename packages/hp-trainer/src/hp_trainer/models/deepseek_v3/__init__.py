"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): latent attention, dense first blocks, shared and
routed experts with the auxiliary-loss-free bias.

``model`` holds the decoder, its attention and router, ``flavors`` its sizes, ``parallelize``
its recipe and attention TP plan, ``state_dict_adapter`` and ``hf_config`` its HuggingFace
mapping.

Registers the ``deepseek_v3`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.deepseek_v3.flavors import deepseek_v3_flavors
from hp_trainer.models.deepseek_v3.hf_config import deepseek_v3_args_from_hf_config
from hp_trainer.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args, MLAttention
from hp_trainer.models.deepseek_v3.parallelize import (
    DEEPSEEK_V3_SHARDING,
    parallelize_deepseek_v3,
)
from hp_trainer.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = [
    "DeepSeekV3",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "MLAttention",
    "deepseek_v3_flavors",
    "parallelize_deepseek_v3",
]

register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=dict(deepseek_v3_flavors),
        model_cls=DeepSeekV3,
        parallelize_fn=parallelize_deepseek_v3,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        pipelining_fn=pipeline_decoder,
        args_from_hf_config=deepseek_v3_args_from_hf_config,
        sharding=DEEPSEEK_V3_SHARDING,  # TP / EP / CP table (CP: SDPA attention, RoPE table)
    )
)
