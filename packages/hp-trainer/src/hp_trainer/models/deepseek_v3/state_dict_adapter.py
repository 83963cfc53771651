"""DeepSeek-V3 <-> HuggingFace ``DeepseekV3ForCausalLM`` (latent attention, stacked experts)."""

from __future__ import annotations

from typing import Any, ClassVar

from hp_trainer.components.hf_io.moe_adapters import MoEStateDictAdapter

__all__ = ["DeepSeekV3StateDictAdapter"]


class DeepSeekV3StateDictAdapter(MoEStateDictAdapter):
    """HF ``DeepseekV3ForCausalLM`` <-> our DeepSeek-V3 (rotary parts stay interleaved).

    Args:
        model_args: The model's :class:`~hp_trainer.DeepSeekV3Args`.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.state_dict_adapter.DeepSeekV3StateDictAdapter`.
    """

    model_type: ClassVar[str] = "deepseek_v3"
    architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    extra_block_keys: ClassVar[dict[str, str]] = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
    }

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.DeepseekV3Config``.
        """
        args: Any = self.args
        moe = args.moe_args
        config = super().hf_config()
        config.update(self._moe_hf_config())
        config.update(
            {
                "num_key_value_heads": args.n_heads,
                "head_dim": args.qk_rope_head_dim,
                "n_routed_experts": moe.num_experts,
                "n_shared_experts": moe.num_shared_experts,
                "routed_scaling_factor": moe.route_scale,
                "n_group": moe.num_expert_groups or 1,
                "topk_group": moe.num_limited_groups or 1,
                "first_k_dense_replace": args.n_dense_layers,
                "q_lora_rank": args.q_lora_rank or None,
                "kv_lora_rank": args.kv_lora_rank,
                "qk_nope_head_dim": args.qk_nope_head_dim,
                "qk_rope_head_dim": args.qk_rope_head_dim,
                "v_head_dim": args.v_head_dim,
                "rope_interleave": True,
                "num_nextn_predict_layers": 0,
            }
        )
        return config
