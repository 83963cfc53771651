"""Qwen 3 MoE (``Qwen3MoeForCausalLM``): QK-normed attention, softmax-routed SwiGLU experts.

``model`` holds the decoder and its router, ``flavors`` its sizes, ``parallelize`` its recipe,
``state_dict_adapter`` and ``hf_config`` its HuggingFace mapping.

Registers the ``qwen3_moe`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.common.expert_parallel import MOE_DECODER_SHARDING
from hp_trainer.models.qwen3_moe.flavors import qwen3_moe_flavors
from hp_trainer.models.qwen3_moe.hf_config import qwen3_moe_args_from_hf_config
from hp_trainer.models.qwen3_moe.model import Qwen3MoE
from hp_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from hp_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = ["Qwen3MoE", "Qwen3MoeStateDictAdapter", "parallelize_qwen3_moe", "qwen3_moe_flavors"]

register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        flavors=dict(qwen3_moe_flavors),
        model_cls=Qwen3MoE,
        parallelize_fn=parallelize_qwen3_moe,
        state_dict_adapter=Qwen3MoeStateDictAdapter,
        pipelining_fn=pipeline_decoder,
        args_from_hf_config=qwen3_moe_args_from_hf_config,
        sharding=MOE_DECODER_SHARDING,  # TP / EP / CP table (CP: SDPA attention, RoPE table)
    )
)
