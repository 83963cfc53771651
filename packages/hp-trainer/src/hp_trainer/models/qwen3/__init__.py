"""Qwen 3 (``Qwen3ForCausalLM``): the dense decoder with per-head QK-norm.

``flavors`` holds its sizes, ``parallelize`` its TP -> AC -> compile -> FSDP recipe,
``state_dict_adapter`` its HuggingFace key mapping.

Registers the ``qwen3`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.common.decoder import Decoder
from hp_trainer.models.common.tensor_parallel import DENSE_DECODER_SHARDING
from hp_trainer.models.qwen3.flavors import qwen3_flavors
from hp_trainer.models.qwen3.parallelize import parallelize_qwen3
from hp_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = ["Qwen3StateDictAdapter", "parallelize_qwen3", "qwen3_flavors"]

register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=dict(qwen3_flavors),
        model_cls=Decoder,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_decoder,
        sharding=DENSE_DECODER_SHARDING,  # TP / EP / CP table (CP: SDPA attention, RoPE table)
        state_dict_adapter=Qwen3StateDictAdapter,
    )
)
