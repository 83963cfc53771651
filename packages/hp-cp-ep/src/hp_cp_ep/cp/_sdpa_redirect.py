"""Route ``F.scaled_dot_product_attention`` calls to the context-parallel engine.

Two routes, one per front:

* :class:`SdpaRoute` (the functional ``context_parallel``): while active, the attribute
  ``torch.nn.functional.scaled_dot_product_attention`` is a router that answers with the
  innermost active engine, as PyTorch's ``context_parallel`` patches it. It must be process-wide:
  an activation checkpoint recomputes the forward inside the backward pass, where the autograd
  engine runs with no :class:`~torch.overrides.TorchFunctionMode` active (and, on accelerators,
  on its own thread), so a mode entered around the step would not see the recomputed SDPA call
  and the recomputation would run single-device attention (observed: a ``CheckpointError``,
  different tensors saved in forward and recomputation).
* :class:`SdpaRedirect` (the module styles): a ``TorchFunctionMode`` entered by the attention
  module's forward hooks, which a recomputation runs again.

Only the masks the engine supports are accepted: none, or ``is_causal``; a dense ``attn_mask``
or a dropout probability raises ``ValueError`` instead of computing something else.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_cp_ep._torch_compat import single_device_sdpa
from hp_cp_ep.cp.attention import ContextParallelAttention
from hp_dtensor._eager import run_eagerly

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


def _call_engine(
    engine: ContextParallelAttention,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    document_ids: torch.Tensor | None = None,
    plans: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Check an SDPA call's arguments against what the engine supports and run it.

    ``document_ids`` (this rank's shard) restrict every query to keys of its document;
    ``plans`` is the route's per-batch plan cache (one plan, one host sync, for every layer).
    """
    a = _bind(args, kwargs)
    if a["attn_mask"] is not None:
        raise ValueError(
            "context-parallel SDPA supports is_causal=True or no mask (and document masks "
            "through context_parallel(document_ids=...) or ContextParallelAttention); got a "
            "dense attn_mask "
            f"of shape {tuple(a['attn_mask'].shape)}"
        )
    if a["dropout_p"] != 0.0:
        raise ValueError(f"context-parallel SDPA supports dropout_p=0.0 only; got {a['dropout_p']}")
    q: torch.Tensor = a["query"]
    k: torch.Tensor = a["key"]
    if not a["enable_gqa"] and q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True for "
            "grouped-query attention"
        )
    return engine(
        q, k, a["value"], is_causal=bool(a["is_causal"]), scale=a["scale"],
        document_ids=document_ids, plan_cache=plans,
    )  # fmt: skip


class _SdpaRouter:
    """The process-wide router installed as ``F.scaled_dot_product_attention`` while needed.

    Holds the stack of active routes (innermost last) and the original function; installs
    itself when the first route is pushed and puts the original back when the last is popped.
    """

    def __init__(self) -> None:
        self.original: Callable[..., torch.Tensor] = single_device_sdpa
        self.routes: list[SdpaRoute] = []
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        routes = self.routes
        if not routes:  # a caller kept a reference to the router past the last exit
            return self.original(*args, **kwargs)
        route = routes[-1]
        return _call_engine(route.engine, args, kwargs, route.document_ids, route.plans)

    def active(self) -> SdpaRoute | None:
        """The innermost active route, or None."""
        routes = self.routes
        return routes[-1] if routes else None

    def push(self, route: SdpaRoute) -> None:
        with self._lock:
            if not self.routes:
                self.original = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = _routed_sdpa
            self.routes.append(route)

    def pop(self, route: SdpaRoute) -> None:
        with self._lock:
            # remove this route (contexts may exit out of order across threads)
            for i in range(len(self.routes) - 1, -1, -1):
                if self.routes[i] is route:
                    del self.routes[i]
                    break
            if not self.routes and F.scaled_dot_product_attention is _routed_sdpa:
                F.scaled_dot_product_attention = self.original


_ROUTER = _SdpaRouter()


# A function (torch.overrides and Dynamo read its name), and opaque to torch.compile: a compiled
# block calls the engine (collectives, autograd functions with Python state) eagerly, as a
# graph break between the compiled pieces around it.
@functools.partial(run_eagerly, reason="the CP engine runs eagerly")
def _routed_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    return _ROUTER(*args, **kwargs)


_routed_sdpa.__name__ = _routed_sdpa.__qualname__ = "scaled_dot_product_attention"


def active_route() -> SdpaRoute | None:
    """The innermost active :class:`SdpaRoute` (a ``context_parallel`` block), or None."""
    return _ROUTER.active()


class SdpaRoute:
    """While active, ``F.scaled_dot_product_attention`` runs context-parallel via ``engine``.

    Process-wide (every thread, the backward pass included), so the recomputation of an
    activation checkpoint run inside the block is context-parallel too. Nested routes: the
    innermost engine answers. ``document_ids`` (this rank's shard, optional) go with every
    call: packed documents. They are fixed while the route is active (one batch), so the
    engine's plan for them is made at the first call and reused by every later one (every
    layer, and the recomputation of a checkpointed layer): one host synchronisation and one
    gather of the ids per batch, not per layer. Every rank makes the same calls in the same
    order, so all ranks reuse the plan together.
    """

    def __init__(
        self, engine: ContextParallelAttention, document_ids: torch.Tensor | None = None
    ) -> None:
        self.engine = engine
        self.document_ids = document_ids
        self.plans: dict[Any, Any] = {}

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        sinks: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        """The engine's attention with a mask description and sinks (the batch's documents
        and plan cache included)."""
        return self.engine(
            query, key, value, scale=scale, document_ids=self.document_ids,
            plan_cache=self.plans, mask=mask, sinks=sinks,
        )  # fmt: skip

    def __enter__(self) -> SdpaRoute:
        _ROUTER.push(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _ROUTER.pop(self)


class SdpaRedirect(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs context-parallel via ``engine``.

    A ``TorchFunctionMode``: this thread only, and not inside a backward pass.
    """

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
        if func is not single_device_sdpa:
            return func(*args, **(kwargs or {}))
        return _call_engine(self.engine, args, kwargs or {})
