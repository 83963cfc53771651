"""Qwen 3 <-> HuggingFace ``Qwen3ForCausalLM`` (the dense mapping, QK-norm scales permuted too)."""

from __future__ import annotations

from typing import ClassVar

from hp_trainer.components.hf_io.adapters import DecoderStateDictAdapter

__all__ = ["Qwen3StateDictAdapter"]


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    """HF ``Qwen3ForCausalLM`` <-> our Qwen 3 decoder (QK-norm scales permuted too).

    Args:
        model_args: The decoder's arguments.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.qwen3.model.state_dict_adapter.Qwen3StateDictAdapter`.
    """

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
