"""Qwen3.5's ``config.json`` reader (``--model.flavor auto``), dense and MoE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import dense_fields_from_hf_config, require_hf_field
from hp_trainer.models.qwen3_5.model import Qwen35Args, Qwen35MoeArgs, qwen3_5_moe_routing

__all__ = ["qwen3_5_args_from_hf_config", "qwen3_5_moe_args_from_hf_config"]

_LINEAR_FIELDS = (
    "linear_conv_kernel_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def _hybrid_fields(config: Mapping[str, Any], source: str, *, moe: bool) -> dict[str, Any]:
    where = f" in {source}" if source else ""
    if "text_config" in config:
        raise ValueError(
            f"config.json{where} is a vision-language Qwen3.5 ({config.get('model_type')!r}); "
            "hp-trainer trains the text decoder: give the text model's config.json "
            "(model_type 'qwen3_5_text' or 'qwen3_5_moe_text')"
        )
    # the MoE config has no dense intermediate size: any value (unused) keeps the reader happy
    dense_config = dict(config) if not moe else {"intermediate_size": 0, **config}
    fields = dense_fields_from_hf_config(dense_config, "qwen3", source)
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    fields.update(
        partial_rotary_factor=float(factor),
        layer_types=tuple(require_hf_field(config, "layer_types", where)),
        **{name: int(require_hf_field(config, name, where)) for name in _LINEAR_FIELDS},
    )
    if moe:
        fields["ffn_hidden_dim"] = None
    return fields


def qwen3_5_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """Qwen3.5 (dense) arguments from an HF ``config.json`` (``model_type: qwen3_5_text``).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.models.qwen3_5.model.Qwen35Args`.

    Raises:
        ValueError: A missing size, a vision-language config, or an option the model lacks.
    """
    return Qwen35Args(**_hybrid_fields(config, source, moe=False))


def qwen3_5_moe_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """Qwen3.5 MoE arguments from an HF ``config.json`` (``model_type: qwen3_5_moe_text``).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.models.qwen3_5.model.Qwen35MoeArgs`.

    Raises:
        ValueError: A missing size, a vision-language config, or an option the model lacks.
    """
    import dataclasses

    where = f" in {source}" if source else ""
    routing = qwen3_5_moe_routing(
        int(require_hf_field(config, "num_experts", where)),
        int(require_hf_field(config, "num_experts_per_tok", where)),
    )
    return Qwen35MoeArgs(
        **_hybrid_fields(config, source, moe=True),
        moe_hidden_dim=int(require_hf_field(config, "moe_intermediate_size", where)),
        shared_expert_hidden_dim=int(
            require_hf_field(config, "shared_expert_intermediate_size", where)
        ),
        moe_args=dataclasses.replace(
            routing, aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0)
        ),
    )
