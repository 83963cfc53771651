"""Llama 3 <-> HuggingFace ``LlamaForCausalLM`` (the dense mapping of
:mod:`hp_trainer.components.hf_io.adapters`)."""

from __future__ import annotations

from typing import ClassVar

from hp_trainer.components.hf_io.adapters import DecoderStateDictAdapter

__all__ = ["Llama3StateDictAdapter"]


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    """HF ``LlamaForCausalLM`` <-> our Llama 3 decoder.

    Args:
        model_args: The decoder's arguments.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.llama3.model.state_dict_adapter.Llama3StateDictAdapter`.
    """

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
