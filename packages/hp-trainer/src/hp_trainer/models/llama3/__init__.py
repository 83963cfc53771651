"""Llama 3 (``LlamaForCausalLM``): the dense decoder of :mod:`hp_trainer.models.common.decoder`.

``flavors`` holds its sizes, ``parallelize`` its TP -> AC -> compile -> FSDP recipe,
``state_dict_adapter`` its HuggingFace key mapping.

Registers the ``llama3`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.common.decoder import Decoder
from hp_trainer.models.common.tensor_parallel import DENSE_DECODER_SHARDING
from hp_trainer.models.llama3.flavors import llama3_flavors
from hp_trainer.models.llama3.parallelize import parallelize_llama
from hp_trainer.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = ["Llama3StateDictAdapter", "llama3_flavors", "parallelize_llama"]

register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=dict(llama3_flavors),
        model_cls=Decoder,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_decoder,
        sharding=DENSE_DECODER_SHARDING,  # TP / EP / CP table (CP: SDPA attention, RoPE table)
        state_dict_adapter=Llama3StateDictAdapter,
    )
)
