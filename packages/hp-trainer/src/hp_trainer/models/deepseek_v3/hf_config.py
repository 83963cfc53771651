"""DeepSeek-V3's ``config.json`` reader: latent attention sizes and group-limited routing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import dense_fields_from_hf_config, require_hf_field
from hp_trainer.models.deepseek_v3.model import DeepSeekV3Args, deepseek_v3_routing

__all__ = ["deepseek_v3_args_from_hf_config"]


def deepseek_v3_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """DeepSeek-V3 arguments from an HF ``config.json`` (``--model.flavor auto``).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.models.deepseek_v3.model.DeepSeekV3Args`.

    Raises:
        ValueError: A missing size or a routing option the model lacks.
    """
    where = f" in {source}" if source else ""
    if not config.get("rope_interleave", True):
        raise ValueError(
            f"rope_interleave false{where}: hp-trainer's DeepSeek-V3 rotates interleaved pairs"
        )
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config.get(key, value) != value:
            raise ValueError(f"{key} {config[key]!r}{where}: DeepSeek-V3 here uses {value!r}")
    groups = int(config.get("n_group") or 1)
    limited = int(config.get("topk_group") or 1)
    routing = deepseek_v3_routing(
        int(require_hf_field(config, "n_routed_experts", where)),
        int(require_hf_field(config, "num_experts_per_tok", where)),
        int(config.get("n_shared_experts") or 0),
        groups if groups > 1 else None,
        limited if groups > 1 else None,
        float(config.get("routed_scaling_factor", 1.0)),
    )
    dense = dense_fields_from_hf_config(
        {**config, "num_key_value_heads": None, "head_dim": None}, "llama", source
    )
    return DeepSeekV3Args(
        **dense,
        moe_hidden_dim=int(require_hf_field(config, "moe_intermediate_size", where)),
        n_dense_layers=int(config.get("first_k_dense_replace") or 0),
        moe_args=dataclasses.replace(
            routing, route_norm=bool(config.get("norm_topk_prob", routing.route_norm))
        ),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(require_hf_field(config, "kv_lora_rank", where)),
        qk_nope_head_dim=int(require_hf_field(config, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(require_hf_field(config, "qk_rope_head_dim", where)),
        v_head_dim=int(require_hf_field(config, "v_head_dim", where)),
    )
