"""HyperParallel's class-style DSA context parallelism: parallel styles for DSA modules.

Each style is applied to a module like any ``ParallelStyle`` (``parallelize_module`` or
``style._apply(module, cp_mesh)``). During that module's forward, the one-device DSA functions
it calls run context-parallel over the mesh, on this rank's sequence shards:

* :class:`DSAIndexerContextParallel`: :func:`~hp_cp_ep.dsa.indexer_topk` becomes
  :func:`~hp_cp_ep.dsa.context_parallel_indexer_topk` (indexer keys all-gathered once);
  :class:`AsyncDSAIndexerContextParallel` passes them around the ring instead, each hop
  overlapped with the scoring of the block in hand.
* :class:`DSASparseAttentionContextParallel` (and :class:`AsyncDSASparseAttentionContextParallel`):
  :func:`~hp_cp_ep.dsa.sparse_latent_attention` and :func:`~hp_cp_ep.dsa.sparse_attention`
  gather the selected rows from their owners
  (:func:`~hp_cp_ep.dsa.context_parallel_sparse_attention`).
* :class:`DSAIndexerLossContextParallel` (and :class:`AsyncDSAIndexerLossContextParallel`):
  :func:`~hp_cp_ep.dsa.sparse_indexer_loss` runs
  :func:`~hp_cp_ep.dsa.context_parallel_sparse_indexer_loss`.
* :class:`DSAGatherCache` (HyperParallel's ``DSASequenceReplicateCache``): one gather plan per
  selection, shared by the styles it is given to, so the attention and the indexer loss of a
  layer read the split sizes from the device once.

Model code stays one-device code; the styles hold no tensors between forwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from hp_cp_ep.dsa import functional as _functional
from hp_cp_ep.dsa.context_parallel import (
    GatherPlan,
    _check_rotate,
    _mesh_group,
    context_parallel_indexer_topk,
    context_parallel_sparse_attention,
    context_parallel_sparse_indexer_loss,
    plan_sparse_gather,
)
from hp_cp_ep.dsa.functional import Expand

__all__ = [
    "AsyncDSAIndexerContextParallel",
    "AsyncDSAIndexerLossContextParallel",
    "AsyncDSASparseAttentionContextParallel",
    "DSAGatherCache",
    "DSAIndexerContextParallel",
    "DSAIndexerLossContextParallel",
    "DSASparseAttentionContextParallel",
]


class DSAGatherCache:
    """Gather plans of the selections met in one forward, shared by several DSA styles.

    HyperParallel's ``DSASequenceReplicateCache`` shares one all-gather of K between the sparse
    attention and the indexer loss of a layer; here nothing is all-gathered, and what the two
    share is the :class:`~hp_cp_ep.dsa.GatherPlan` of the selection (the split sizes, the one
    host synchronisation of a layer). A plan is reused when the same ``indices`` tensor comes
    back (compared by identity); the styles clear the cache when their module's forward ends.

    Example:
        >>> # cache = DSAGatherCache()
        >>> # DSASparseAttentionContextParallel(gather_cache=cache)._apply(attn, cp_mesh)
        >>> # DSAIndexerLossContextParallel(gather_cache=cache)._apply(loss_module, cp_mesh)

    See Also:
        :pt:`torch.distributed.all_to_all_single`: the collective whose sizes the plan holds.
    """

    def __init__(self) -> None:
        self._plans: list[tuple[torch.Tensor, GatherPlan]] = []

    def plan(
        self, indices: torch.Tensor, *, local_len: int, mesh: DeviceMesh, load_balance: bool
    ) -> GatherPlan:
        """The plan of ``indices``: made on first sight (one host sync), reused after."""
        for seen, plan in self._plans:
            if seen is indices:
                return plan
        plan = plan_sparse_gather(
            indices, local_len=local_len, mesh=mesh, load_balance=load_balance
        )
        self._plans.append((indices, plan))
        return plan

    def clear(self) -> None:
        """Drop every plan (the styles call it when their module's forward ends)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class _Attention:
    """The routed sparse-attention calls of one module."""

    def __init__(self, mesh: DeviceMesh, load_balance: bool, cache: DSAGatherCache) -> None:
        self.mesh, self.load_balance, self.cache = mesh, load_balance, cache

    def latent(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, **kw: Any) -> Any:
        plan = self.cache.plan(
            indices, local_len=kv.shape[1], mesh=self.mesh, load_balance=self.load_balance
        )
        return context_parallel_sparse_attention(
            q, kv, indices, mesh=self.mesh, load_balance=self.load_balance, plan=plan, **kw
        )

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, **kw: Any
    ) -> Any:
        """``sparse_attention`` on local K/V heads: their rows travel packed as one row."""
        b, hk, s, d = k.shape
        dv = v.shape[-1]
        if tuple(v.shape[:3]) != (b, hk, s):
            raise ValueError(
                f"v must be [B, Hk, s, Dv] = [{b}, {hk}, {s}, Dv]; got {tuple(v.shape)}"
            )
        rows = torch.cat([k.transpose(1, 2), v.transpose(1, 2)], dim=-1).reshape(b, s, -1)

        def unpack(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r = r.view(-1, hk, d + dv)
            return r[..., :d], r[..., d:]

        return self.latent(q, rows, indices, expand=unpack, **kw)


class _Route:
    """Per-module routing state: which DSA calls run context-parallel, and how."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.caches: list[DSAGatherCache] = []
        self._tokens: list[Any] = []

    def handler(self, role: str) -> Any:
        return self.handlers.get(role)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._tokens.append(_functional._ROUTE.set(self))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._tokens:  # always_call: also when the forward raised
            _functional._ROUTE.reset(self._tokens.pop())
        if not self._tokens:
            for cache in self.caches:
                cache.clear()

    @classmethod
    def of(cls, module: nn.Module) -> _Route:
        route = module.__dict__.get("_hp_dsa_cp_route")
        if route is None:
            route = cls()
            module.__dict__["_hp_dsa_cp_route"] = route
            module.register_forward_pre_hook(route._enter)
            module.register_forward_hook(route._exit, always_call=True)
        return route


def _unrouted(fn: Any) -> Any:
    """Run ``fn`` with no route active (so a cp == 1 fallback cannot loop back here)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        token = _functional._ROUTE.set(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _functional._ROUTE.reset(token)

    return call


class DSAIndexerContextParallel(ParallelStyle):
    """Make a module's :func:`~hp_cp_ep.dsa.indexer_topk` calls context-parallel (all-gather).

    The indexer inputs the module passes are this rank's sequence shards; the returned top-k
    holds *global* positions (for :class:`DSASparseAttentionContextParallel`).

    Args:
        load_balance: Keyword-only. The shards are head-tail (zigzag), as
            :func:`hp_cp_ep.shard_sequence` cuts them by default.
        rotate_method: Keyword-only. ``"allgather"`` (HyperParallel's: gather the indexer keys,
            then score) or ``"ring"`` / ``"alltoall"`` (ring, each hop overlapped with scoring).

    Raises:
        ValueError: A rotate method DSA cannot use (``"ulysses"``: the indexer's heads must
            stay whole), named in the message; at apply time a mesh that is not 1-D.

    Example:
        >>> # DSAIndexerContextParallel()._apply(attention, cp_mesh)

    See Also:
        :pt:`torch.distributed.tensor.parallel.ParallelStyle`: the style protocol.
    """

    default_rotate = "allgather"

    def __init__(self, *, load_balance: bool = True, rotate_method: str | None = None) -> None:
        super().__init__()
        self.rotate_method = rotate_method or self.default_rotate
        _check_rotate(self.rotate_method)
        self.load_balance = load_balance

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        if device_mesh.size() == 1:
            return module

        def topk(*args: Any, **kwargs: Any) -> Any:
            return context_parallel_indexer_topk(
                *args, mesh=device_mesh, load_balance=self.load_balance,
                rotate_method=self.rotate_method, **kwargs,
            )  # fmt: skip

        _Route.of(module).handlers["indexer"] = _unrouted(topk)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(load_balance={self.load_balance}, "
            f"rotate_method={self.rotate_method!r})"
        )


class AsyncDSAIndexerContextParallel(DSAIndexerContextParallel):
    """:class:`DSAIndexerContextParallel` with the keys on the ring, hops overlapped.

    Each ring hop (``batch_isend_irecv`` of the next block) is issued before the block in
    hand is scored and awaited after: HyperParallel's pre-launched key exchange, without
    holding every rank's keys at once. Same arguments; ``rotate_method`` defaults to
    ``"ring"``.

    See Also:
        :pt:`torch.distributed.batch_isend_irecv`
    """

    default_rotate = "ring"


class _GatherStyle(ParallelStyle):
    def __init__(
        self, *, load_balance: bool = True, gather_cache: DSAGatherCache | None = None
    ) -> None:
        super().__init__()
        self.load_balance = load_balance
        self.gather_cache = gather_cache

    def _cache(self, route: _Route) -> DSAGatherCache:
        cache = self.gather_cache
        if cache is None:  # one per module: the attention and the loss of it share plans
            cache = route.caches[0] if route.caches else DSAGatherCache()
        if cache not in route.caches:
            route.caches.append(cache)
        return cache

    def __repr__(self) -> str:
        return f"{type(self).__name__}(load_balance={self.load_balance})"


class DSASparseAttentionContextParallel(_GatherStyle):
    """Make a module's sparse-attention calls gather the selected rows from their owners.

    Inside the module's forward, :func:`~hp_cp_ep.dsa.sparse_latent_attention` runs
    :func:`~hp_cp_ep.dsa.context_parallel_sparse_attention` (the compressed rows travel, then
    are expanded here) and :func:`~hp_cp_ep.dsa.sparse_attention` does the same with the local
    K/V heads packed as one row per position. ``indices`` must hold global positions (from
    :class:`DSAIndexerContextParallel`).

    Args:
        load_balance: Keyword-only. Head-tail shards.
        gather_cache: Keyword-only. A :class:`DSAGatherCache` shared with other styles (by
            default one per module, shared with a loss style on the same module).

    Example:
        >>> # DSASparseAttentionContextParallel()._apply(attention, cp_mesh)

    See Also:
        :pt:`torch.distributed.tensor.parallel.ParallelStyle`
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        if device_mesh.size() == 1:
            return module
        route = _Route.of(module)
        attention = _Attention(device_mesh, self.load_balance, self._cache(route))
        attention.latent = _unrouted(attention.latent)  # type: ignore[method-assign]
        route.handlers["attention"] = attention
        return module


class AsyncDSASparseAttentionContextParallel(DSASparseAttentionContextParallel):
    """HyperParallel's async sparse-attention style: the same gather as the sync one.

    HyperParallel's async variant pre-launches the all-gather of whole K/V; nothing whole is
    gathered here (the rows travel once the selection is known), so this class behaves as
    :class:`DSASparseAttentionContextParallel`; the overlap of DSA context parallelism is the
    ring of :class:`AsyncDSAIndexerContextParallel`. Same arguments.

    See Also:
        :pt:`torch.distributed.all_to_all_single`
    """


class DSAIndexerLossContextParallel(_GatherStyle):
    """Make a module's :func:`~hp_cp_ep.dsa.sparse_indexer_loss` calls context-parallel.

    The selected indexer keys and compressed rows are fetched from their owners with the plan
    of the selection (shared with the sparse attention through the module's or the given
    :class:`DSAGatherCache`); the indexer keys' gradients go back to their owners.

    Args:
        load_balance: Keyword-only. Head-tail shards.
        gather_cache: Keyword-only. A shared :class:`DSAGatherCache`.

    See Also:
        :pt:`torch.nn.functional.kl_div`
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        if device_mesh.size() == 1:
            return module
        route = _Route.of(module)
        cache = self._cache(route)

        def loss(
            index_q: torch.Tensor,
            index_k: torch.Tensor,
            weights: torch.Tensor,
            q: torch.Tensor,
            kv: torch.Tensor,
            indices: torch.Tensor,
            *,
            softmax_scale: float,
            scale: float,
            expand: Expand | None = None,
        ) -> torch.Tensor:
            plan = cache.plan(
                indices, local_len=kv.shape[1], mesh=device_mesh, load_balance=self.load_balance
            )
            return context_parallel_sparse_indexer_loss(
                index_q, index_k, weights, q, kv, indices, softmax_scale=softmax_scale,
                scale=scale, mesh=device_mesh, expand=expand, load_balance=self.load_balance,
                plan=plan,
            )  # fmt: skip

        route.handlers["loss"] = _unrouted(loss)
        return module


class AsyncDSAIndexerLossContextParallel(DSAIndexerLossContextParallel):
    """HyperParallel's async indexer-loss style: the same gather as the sync one.

    As :class:`AsyncDSASparseAttentionContextParallel`: nothing whole is pre-gathered here, so
    it behaves as :class:`DSAIndexerLossContextParallel`. Same arguments.

    See Also:
        :pt:`torch.nn.functional.kl_div`
    """
