"""Llama 4 (``Llama4ForCausalLM``, the text model): iRoPE, chunked attention, interleaved MoE
with a shared expert and a top-1 sigmoid router.

``model`` holds the decoder, its attention and router, ``flavors`` its sizes, ``parallelize``
its recipe and sharding table, ``state_dict_adapter`` and ``hf_config`` its HuggingFace
mapping.

Registers the ``llama4`` model spec on import.
"""

from hp_trainer.distributed.pipeline import pipeline_decoder
from hp_trainer.models.llama4.flavors import llama4_flavors
from hp_trainer.models.llama4.hf_config import llama4_args_from_hf_config
from hp_trainer.models.llama4.model import Llama4, Llama4Args, Llama4Attention, llama4_routing
from hp_trainer.models.llama4.parallelize import LLAMA4_SHARDING, parallelize_llama4
from hp_trainer.models.llama4.state_dict_adapter import Llama4StateDictAdapter
from hp_trainer.protocols.model_spec import ModelSpec, register_model_spec

__all__ = [
    "LLAMA4_SHARDING",
    "Llama4",
    "Llama4Args",
    "Llama4Attention",
    "Llama4StateDictAdapter",
    "llama4_args_from_hf_config",
    "llama4_flavors",
    "llama4_routing",
    "parallelize_llama4",
]

register_model_spec(
    ModelSpec(
        name="llama4",
        flavors=dict(llama4_flavors),
        model_cls=Llama4,
        parallelize_fn=parallelize_llama4,
        state_dict_adapter=Llama4StateDictAdapter,
        pipelining_fn=pipeline_decoder,
        args_from_hf_config=llama4_args_from_hf_config,
        sharding=LLAMA4_SHARDING,  # TP / EP table (no CP section: CP is refused)
    )
)
