"""Qwen 3 MoE <-> HuggingFace ``Qwen3MoeForCausalLM`` (per-expert matrices there, stacked here)."""

from __future__ import annotations

from typing import Any, ClassVar

from hp_trainer.components.hf_io.moe_adapters import MoEStateDictAdapter

__all__ = ["Qwen3MoeStateDictAdapter"]


class Qwen3MoeStateDictAdapter(MoEStateDictAdapter):
    """HF ``Qwen3MoeForCausalLM`` <-> our Qwen 3 MoE (rotary rows and QK-norms permuted).

    Args:
        model_args: The model's arguments.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.qwen3.model.state_dict_adapter.Qwen3StateDictAdapter`.
    """

    model_type: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.Qwen3MoeConfig``.
        """
        args: Any = self.args
        config = super().hf_config()
        config.update(self._moe_hf_config())
        config.update(
            {
                "num_experts": args.moe_args.num_experts,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(args.n_dense_layers)),
                "router_aux_loss_coef": args.moe_args.aux_loss_coeff,
            }
        )
        return config
