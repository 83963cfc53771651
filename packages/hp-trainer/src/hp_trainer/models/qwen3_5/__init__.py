"""Qwen3.5 (``Qwen3_5ForCausalLM``): the Gated DeltaNet / gated-attention hybrid, text decoder.

``model`` holds the blocks and decoders (dense :class:`Qwen35`, MoE :class:`Qwen35Moe`),
``delta_rule`` the gated delta rule (chunked training form and recurrent reference) and the
causal depthwise conv, ``flavors`` the sizes, ``parallelize`` the sharding tables and
``parallelize_qwen3_5``, ``state_dict_adapter`` and ``hf_config`` the HuggingFace mapping.

Registers the ``qwen3_5`` model spec on import (``qwen3_5_moe`` registers the MoE flavor).
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.qwen3_5.delta_rule import (
    causal_depthwise_conv,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from hp_trainer.models.qwen3_5.flavors import qwen3_5_flavors, qwen3_5_moe_flavors
from hp_trainer.models.qwen3_5.hf_config import (
    qwen3_5_args_from_hf_config,
    qwen3_5_moe_args_from_hf_config,
)
from hp_trainer.models.qwen3_5.model import (
    GatedAttention,
    GatedDeltaNet,
    Qwen35,
    Qwen35Args,
    Qwen35Moe,
    Qwen35MoeArgs,
)
from hp_trainer.models.qwen3_5.parallelize import (
    QWEN3_5_MOE_SHARDING,
    QWEN3_5_SHARDING,
    parallelize_qwen3_5,
    qwen3_5_job_error,
    qwen3_5_layout_error,
)
from hp_trainer.models.qwen3_5.state_dict_adapter import (
    Qwen35MoeStateDictAdapter,
    Qwen35StateDictAdapter,
)
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = [
    "GatedAttention",
    "GatedDeltaNet",
    "Qwen35",
    "Qwen35Args",
    "Qwen35Moe",
    "Qwen35MoeArgs",
    "Qwen35MoeStateDictAdapter",
    "Qwen35StateDictAdapter",
    "causal_depthwise_conv",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "parallelize_qwen3_5",
    "qwen3_5_flavors",
    "qwen3_5_moe_flavors",
]

register_model_spec(
    ModelSpec(
        name="qwen3_5",
        flavors=dict(qwen3_5_flavors),
        model_cls=Qwen35,
        parallelize_fn=parallelize_qwen3_5,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=Qwen35StateDictAdapter,
        args_from_hf_config=qwen3_5_args_from_hf_config,
        sharding=QWEN3_5_SHARDING,  # TP only: CP refused (the linear-attention state)
        # checked up front: CP refused with its reason and TP dividing the Gated DeltaNet heads
        # (validate_parallel_layout), compile refused (when the job is parsed)
        layout_check=qwen3_5_layout_error,
        job_check=qwen3_5_job_error,
    )
)

register_model_spec(
    ModelSpec(
        name="qwen3_5_moe",
        flavors=dict(qwen3_5_moe_flavors),
        model_cls=Qwen35Moe,
        parallelize_fn=parallelize_qwen3_5,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=Qwen35MoeStateDictAdapter,
        args_from_hf_config=qwen3_5_moe_args_from_hf_config,
        sharding=QWEN3_5_MOE_SHARDING,  # TP / EP; CP refused (the linear-attention state)
        # checked up front: CP refused with its reason and TP dividing the Gated DeltaNet heads
        # (validate_parallel_layout), compile refused (when the job is parsed)
        layout_check=qwen3_5_layout_error,
        job_check=qwen3_5_job_error,
    )
)
