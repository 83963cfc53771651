"""gpt-oss's ``config.json`` reader (``--model.flavor auto``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import require_hf_field, rope_scaling_from_hf
from hp_trainer.models.gpt_oss.model import LAYER_TYPES, GptOssArgs, gpt_oss_routing

__all__ = ["gpt_oss_args_from_hf_config"]

_HF_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta


def _rope_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(config.get("rope_theta") or _HF_DEFAULT_THETA)


def gpt_oss_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """gpt-oss arguments from an HF ``config.json`` (``GptOssConfig``'s fields).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The ``GptOssArgs``.

    Raises:
        ValueError: A missing size, an activation other than ``silu``, or a ``layer_types``
            entry the model lacks.

    See Also:
        ``transformers.GptOssConfig``.
    """
    where = f" in {source}" if source else ""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act {config['hidden_act']!r}{where}: gpt-oss's experts use the clamped "
            "SwiGLU ('silu')"
        )
    heads = int(require_hf_field(config, "num_attention_heads", where))
    dim = int(require_hf_field(config, "hidden_size", where))
    n_layers = int(require_hf_field(config, "num_hidden_layers", where))
    layer_types = config.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown}{where}: gpt-oss has {LAYER_TYPES} only")
    window = config.get("sliding_window")
    rope_scaling = rope_scaling_from_hf(config)
    return GptOssArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or dim // heads),
        vocab_size=int(require_hf_field(config, "vocab_size", where)),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=_rope_theta(config),
        rope_scaling=rope_scaling,
        max_seq_len=int(config.get("max_position_embeddings", 131072)),
        enable_weight_tying=bool(config.get("tie_word_embeddings", False)),
        moe_hidden_dim=int(require_hf_field(config, "intermediate_size", where)),
        moe_args=gpt_oss_routing(
            int(require_hf_field(config, "num_local_experts", where)),
            int(require_hf_field(config, "num_experts_per_tok", where)),
            aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0),
        ),
        sliding_window=None if window is None else int(window),
        layer_types=None if layer_types is None else tuple(layer_types),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        attention_bias=bool(config.get("attention_bias", True)),
    )
