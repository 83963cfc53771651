"""Route ``F.scaled_dot_product_attention`` calls to the context-parallel engine.

A :class:`~torch.overrides.TorchFunctionMode` sees every call of a torch function made while it
is active; :class:`SdpaRedirect` answers the SDPA calls with the engine and lets everything else
through. Only the masks the engine supports are accepted: none, or ``is_causal``; a dense
``attn_mask`` or a dropout probability raises ``ValueError`` instead of computing something else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_cp_ep.cp.attention import ContextParallelAttention

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def _bind(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


class SdpaRedirect(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs context-parallel via ``engine``."""

    def __init__(self, engine: ContextParallelAttention) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        a = _bind(args, kwargs or {})
        if a["attn_mask"] is not None:
            raise ValueError(
                "context-parallel SDPA supports is_causal=True or no mask (and document masks "
                "through ContextParallelAttention in 'allgather' mode); got a dense attn_mask "
                f"of shape {tuple(a['attn_mask'].shape)}"
            )
        if a["dropout_p"] != 0.0:
            raise ValueError(
                f"context-parallel SDPA supports dropout_p=0.0 only; got {a['dropout_p']}"
            )
        q: torch.Tensor = a["query"]
        k: torch.Tensor = a["key"]
        if not a["enable_gqa"] and q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]:
            raise ValueError(
                f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True for "
                "grouped-query attention"
            )
        return self.engine(q, k, a["value"], is_causal=bool(a["is_causal"]), scale=a["scale"])
