"""DeepSeek-V3.2 <-> HuggingFace ``DeepseekV32ForCausalLM`` (V3's keys plus the indexer's)."""

from __future__ import annotations

from typing import Any, ClassVar

from hp_trainer.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

__all__ = ["DeepSeekV32StateDictAdapter"]


class DeepSeekV32StateDictAdapter(DeepSeekV3StateDictAdapter):
    """HF ``DeepseekV32ForCausalLM`` <-> our DeepSeek-V3.2 (the indexer's weights renamed).

    Args:
        model_args: The model's :class:`~hp_trainer.DeepSeekV32Args`.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.state_dict_adapter.DeepSeekV3StateDictAdapter`
        (the V3 keys); ``transformers.DeepseekV32ForCausalLM``.
    """

    model_type: ClassVar[str] = "deepseek_v32"
    architecture: ClassVar[str] = "DeepseekV32ForCausalLM"
    extra_block_keys: ClassVar[dict[str, str]] = {
        **DeepSeekV3StateDictAdapter.extra_block_keys,
        "attention.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
        "attention.indexer.wk.weight": "self_attn.indexer.wk.weight",
        "attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
        "attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
        "attention.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    }

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.DeepseekV32Config``.
        """
        args: Any = self.args
        config = super().hf_config()
        config.pop("rope_interleave", None)  # V3.2's main attention is always interleaved
        config.update(
            {
                "index_n_heads": args.index_n_heads,
                "index_head_dim": args.index_head_dim,
                "index_topk": args.index_topk,
            }
        )
        return config
