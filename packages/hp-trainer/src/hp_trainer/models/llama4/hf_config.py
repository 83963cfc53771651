"""Llama 4's ``config.json`` reader (``llama4_text``: ``Llama4ForCausalLM`` checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import dense_fields_from_hf_config, require_hf_field
from hp_trainer.models.llama4.model import Llama4Args, llama4_routing

__all__ = ["llama4_args_from_hf_config"]


def llama4_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """Llama 4 arguments from an HF ``config.json`` (``--model.flavor auto``).

    Training-only router options keep their defaults: ``Llama4ForCausalLM`` adds no auxiliary
    loss (``router_aux_loss_coef`` is not used by its forward).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.models.llama4.model.Llama4Args`.

    Raises:
        ValueError: A missing size, attention biases, or an activation other than SiLU.

    See Also:
        ``transformers.Llama4TextConfig``.
    """
    where = f" in {source}" if source else ""
    dense = dense_fields_from_hf_config(
        {**config, "intermediate_size": require_hf_field(config, "intermediate_size_mlp", where)},
        "llama",
        source,
    )
    routing = llama4_routing(
        int(require_hf_field(config, "num_local_experts", where)),
        int(config.get("num_experts_per_tok") or 1),
    )
    n_layers = int(dense["n_layers"])
    step = int(config.get("interleave_moe_layer_step") or 1)
    interval = int(config.get("no_rope_layer_interval") or 4)
    moe_layers = config.get("moe_layers")
    if moe_layers is not None:  # kept only where it differs from the interleave step's
        moe_layers = tuple(int(i) for i in moe_layers)
        if moe_layers == tuple(range(step - 1, n_layers, step)):
            moe_layers = None
    no_rope_layers = config.get("no_rope_layers") or None  # HF: empty means "from interval"
    if no_rope_layers is not None:
        no_rope_layers = tuple(int(f) for f in no_rope_layers)
        if no_rope_layers[:n_layers] == tuple(
            int((i + 1) % interval != 0) for i in range(n_layers)
        ):
            no_rope_layers = None
    chunk = config.get("attention_chunk_size", 8192)
    return Llama4Args(
        **{**dense, "qk_norm": bool(config.get("use_qk_norm", True))},
        moe_hidden_dim=int(require_hf_field(config, "intermediate_size", where)),
        moe_args=routing,
        interleave_moe_layer_step=step,
        moe_layers=moe_layers,
        no_rope_layer_interval=interval,
        no_rope_layers=no_rope_layers,
        attention_chunk_size=None if chunk is None else int(chunk),
        attn_temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
        floor_scale=float(config.get("floor_scale", 8192)),
        attn_scale=float(config.get("attn_scale", 0.1)),
    )
