"""Qwen3.5 MoE (``Qwen3_5MoeForCausalLM``): the registry name of the MoE flavor.

The model, its sizes and its recipe live in :mod:`hp_trainer.models.qwen3_5` (one family);
importing that package registers both ``qwen3_5`` and ``qwen3_5_moe``.
"""

from hp_trainer.models.qwen3_5 import (
    Qwen35Moe,
    Qwen35MoeArgs,
    Qwen35MoeStateDictAdapter,
    parallelize_qwen3_5,
    qwen3_5_moe_flavors,
)

__all__ = [
    "Qwen35Moe",
    "Qwen35MoeArgs",
    "Qwen35MoeStateDictAdapter",
    "parallelize_qwen3_5",
    "qwen3_5_moe_flavors",
]
