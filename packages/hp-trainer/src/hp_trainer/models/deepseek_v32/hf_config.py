"""DeepSeek-V3.2's ``config.json`` reader: DeepSeek-V3's fields plus the indexer's sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hp_trainer.components.hf_io.config import require_hf_field
from hp_trainer.models.deepseek_v3.hf_config import deepseek_v3_args_from_hf_config
from hp_trainer.models.deepseek_v32.model import DeepSeekV32Args

__all__ = ["deepseek_v32_args_from_hf_config"]


def deepseek_v32_args_from_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """DeepSeek-V3.2 arguments from an HF ``config.json`` (``--model.flavor auto``).

    Args:
        config: The HF configuration (``model_type`` ``deepseek_v32``).
        source: Where it came from, for error messages.

    Returns:
        The :class:`~hp_trainer.DeepSeekV32Args`.

    Raises:
        ValueError: A missing size, a routing option the model lacks, or indexer sizes the
            model cannot take (naming the values).

    See Also:
        ``transformers.DeepseekV32Config``.
    """
    where = f" in {source}" if source else ""
    v3 = deepseek_v3_args_from_hf_config(config, source)
    fields = {f.name: getattr(v3, f.name) for f in dataclasses.fields(v3) if f.init}
    fields.pop("head_dim", None)  # derived again from the latent sizes
    try:
        return DeepSeekV32Args(
            **fields,
            index_n_heads=int(require_hf_field(config, "index_n_heads", where)),
            index_head_dim=int(require_hf_field(config, "index_head_dim", where)),
            index_topk=int(require_hf_field(config, "index_topk", where)),
        )
    except ValueError as exc:
        raise ValueError(f"{exc}{where}") from None
