"""Qwen 3 MoE's ``config.json`` reader: routing, expert sizes, dense first blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import dense_fields_from_hf_config, require_hf_field
from hp_trainer.models.common.moe_decoder import MoEDecoderArgs
from hp_trainer.models.qwen3_moe.model import qwen3_moe_routing

__all__ = ["qwen3_moe_args_from_hf_config"]


def _dense_first_blocks(config: Mapping[str, Any], where: str) -> int:
    """Qwen 3 MoE's ``mlp_only_layers`` as a count of dense first blocks (all the decoder has)."""
    if int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"decoder_sparse_step {config['decoder_sparse_step']}{where}: hp-trainer's MoE "
            "decoder has MoE blocks after its dense first blocks only (decoder_sparse_step 1)"
        )
    dense = sorted(int(i) for i in config.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ValueError(
            f"mlp_only_layers {dense}{where}: hp-trainer's MoE decoder has dense blocks first "
            "only (mlp_only_layers = [0, 1, ..., k - 1])"
        )
    return len(dense)


def qwen3_moe_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """Qwen 3 MoE arguments from an HF ``config.json`` (``--model.flavor auto``).

    Args:
        config: The HF configuration.
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.models.common.moe_decoder.MoEDecoderArgs`.

    Raises:
        ValueError: A missing size or a layout the decoder lacks.
    """
    where = f" in {source}" if source else ""
    routing = qwen3_moe_routing(
        int(require_hf_field(config, "num_experts", where)),
        int(require_hf_field(config, "num_experts_per_tok", where)),
    )
    return MoEDecoderArgs(
        **dense_fields_from_hf_config(config, "qwen3", source),
        moe_hidden_dim=int(require_hf_field(config, "moe_intermediate_size", where)),
        n_dense_layers=_dense_first_blocks(config, where),
        moe_args=dataclasses.replace(
            routing,
            route_norm=bool(config.get("norm_topk_prob", routing.route_norm)),
            aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0),
        ),
    )
