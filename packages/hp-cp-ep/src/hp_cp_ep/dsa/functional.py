"""DeepSeek sparse attention (DSA) on one device: the indexer's top-k and sparse attention.

DeepSeek-V3.2's DSA lets every query attend to ``topk`` keys only. A *lightning indexer* with its
own small heads scores every visible key,

    ``score[b, s, t] = sum_h weights[b, s, h] * relu(softmax_scale * q[b, s, h] . k[b, t])``

(the scale is applied to the dot product before the ReLU, and the per-head ``weights`` after it,
in the order ``transformers``' ``DeepseekV32Indexer`` computes them), masks the keys a query may
not see (causal, and other documents when ``document_ids`` is given) and keeps the ``topk``
best. Attention then runs on the selected keys only.

Selection order: keys are ranked by score, highest first; equal scores are ranked by key
position, earliest first. The ranking is a total order, so the selection does not depend on how
the keys are partitioned: the context-parallel merge in ``hp_cp_ep.dsa``
reproduces it exactly from per-block candidates. A slot with no visible key left holds ``-1``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "indexer_scores",
    "indexer_topk",
    "sparse_attention",
    "sparse_indexer_loss",
    "sparse_latent_attention",
]


#: The context-parallel route of the module forward running now (set by the styles of
#: ``hp_cp_ep.dsa.style`` for the duration of a forward; ``None`` outside): a context-manager
#: flag, not global state.
_ROUTE: ContextVar[Any] = ContextVar("hp_cp_ep_dsa_route", default=None)


def _routed(role: str) -> Any:
    """The route's handler for ``role`` in the forward running now, or ``None``."""
    route = _ROUTE.get()
    return None if route is None else route.handler(role)


def _check_rank(name: str, tensor: torch.Tensor, dims: int, shape: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}; got {type(tensor).__name__}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {shape}; got shape {tuple(tensor.shape)}")


def _check_indexer_inputs(
    index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor
) -> None:
    _check_rank("index_q", index_q, 4, "[B, S, Hi, Di]")
    _check_rank("index_k", index_k, 3, "[B, T, Di]")
    _check_rank("weights", weights, 3, "[B, S, Hi]")
    b, s, h, d = index_q.shape
    if index_k.shape[0] != b or index_k.shape[2] != d:
        raise ValueError(
            f"index_k must be [B={b}, T, Di={d}] to match index_q {tuple(index_q.shape)}; "
            f"got {tuple(index_k.shape)}"
        )
    if tuple(weights.shape) != (b, s, h):
        raise ValueError(
            f"weights must be [B, S, Hi] = {(b, s, h)} to match index_q; got {tuple(weights.shape)}"
        )


def indexer_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor, *, softmax_scale: float
) -> torch.Tensor:
    """The lightning indexer's scores of every query against every key (no mask), in fp32.

    Args:
        index_q: Indexer queries ``[B, S, Hi, Di]`` (RoPE already applied).
        index_k: Indexer keys ``[B, T, Di]`` (one head shared by all indexer heads).
        weights: Per-query head weights ``[B, S, Hi]``, as ``transformers`` passes them
            (``weights_proj(x) * Hi ** -0.5``).
        softmax_scale: Scale of the dot products (``Di ** -0.5`` in DeepSeek-V3.2).

    Returns:
        ``[B, S, T]`` float32: ``sum_h weights * relu(softmax_scale * q . k)``.

    See Also:
        :func:`indexer_topk`: the masked top-k selection over these scores.
    """
    _check_indexer_inputs(index_q, index_k, weights)
    dots = torch.matmul(index_q.float(), index_k.float().transpose(-1, -2).unsqueeze(1))
    dots = F.relu(dots * softmax_scale)  # [B, S, Hi, T]
    return torch.matmul(weights.float().unsqueeze(-2), dots).squeeze(-2)


def _visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_docs: torch.Tensor | None,
    k_docs: torch.Tensor | None,
) -> torch.Tensor:
    """``[B or 1, S, T]`` bool: key at ``k_pos`` is visible from the query at ``q_pos``."""
    mask = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).unsqueeze(0)
    if q_docs is not None and k_docs is not None:
        mask = mask & (q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2))
    return mask


def _rank_candidates(
    scores: torch.Tensor, keys: torch.Tensor, topk: int, *, keys_sorted: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` best ``(score, key)`` pairs along the last dim: score desc, then key asc.

    Masked candidates carry ``-inf``; they rank last (their keys are replaced by ``-1`` later).
    ``keys_sorted`` says ``keys`` is already ascending along the last dim (skips one sort).
    """
    if not keys_sorted:
        keys, order = keys.sort(dim=-1)
        scores = scores.gather(-1, order)
    scores, order = scores.sort(dim=-1, descending=True, stable=True)
    k = min(topk, scores.shape[-1])
    return scores[..., :k], keys.gather(-1, order[..., :k])


def _finish(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return keys.masked_fill(scores == float("-inf"), -1)


def _check_topk(topk: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int; got {type(topk).__name__}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1; got {topk}")


@torch.no_grad()
def indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    softmax_scale: float,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lightning indexer's top-k keys of every query (causal, optionally per document).

    Args:
        index_q: Indexer queries ``[B, S, Hi, Di]``.
        index_k: Indexer keys ``[B, T, Di]`` with ``T == S`` (query ``s`` and key ``s`` are the
            same position).
        weights: Per-query head weights ``[B, S, Hi]`` (``transformers``'
            ``weights_proj(x) * Hi ** -0.5``).
        topk: Keys kept per query. Larger than the visible context is allowed: the slots with
            no visible key left hold ``-1``.
        softmax_scale: Scale of the dot products.
        document_ids: Optional ``[B, S]`` (or ``[S]``) integer ids of packed documents: a query
            sees only keys of its own document.

    Returns:
        int64 ``[B, S, min(topk, T)]``: the selected key positions, best first (ties: earlier
        key first), ``-1`` in slots without a visible key. No gradient flows (as in
        ``transformers``, the indexer is trained by its own loss).

    Raises:
        TypeError: A non-tensor input or a non-int ``topk``.
        ValueError: Shapes that do not match, ``T != S`` or ``topk < 1``.

    Example:
        >>> idx = indexer_topk(iq, ik, w, 2048, softmax_scale=iq.shape[-1] ** -0.5)

    See Also:
        :func:`sparse_attention`; ``hp_cp_ep.dsa`` also computes the same selection with the
        sequence sharded over a context-parallel group.
    """
    routed = _routed("indexer")
    if routed is not None:
        return routed(  # type: ignore[no-any-return]
            index_q, index_k, weights, topk, softmax_scale=softmax_scale, document_ids=document_ids
        )
    _check_topk(topk)
    _check_indexer_inputs(index_q, index_k, weights)
    s, t = index_q.shape[1], index_k.shape[1]
    if s != t:
        raise ValueError(
            f"indexer_topk on one device needs as many keys as queries; got S={s}, T={t}"
        )
    scores = indexer_scores(index_q, index_k, weights, softmax_scale=softmax_scale)
    pos = torch.arange(s, device=scores.device)
    docs = None
    if document_ids is not None:
        docs = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0)
        if docs.shape[-1] != s:
            raise ValueError(
                f"document_ids must be [B, S] or [S] with S={s}; got {tuple(document_ids.shape)}"
            )
    scores = scores.masked_fill(~_visible(pos, pos, docs, docs), float("-inf"))
    keys = pos.expand_as(scores)
    top_scores, top_keys = _rank_candidates(scores, keys, topk, keys_sorted=True)
    return _finish(top_scores, top_keys)


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x [B, Hk, T, D]`` rows at ``indices [B, S, K]`` (``>= 0``): ``[B, Hk, S, K, D]``."""
    b, hk, t, d = x.shape
    _, s, k = indices.shape
    flat = x.transpose(1, 2).reshape(b * t, hk * d)
    offsets = (torch.arange(b, device=indices.device) * t).view(b, 1, 1)
    rows = flat.index_select(0, (indices + offsets).reshape(-1))
    return rows.view(b, s, k, hk, d).permute(0, 3, 1, 2, 4)


def _attend_selected(
    q: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of ``q [B, H, S, D]`` over gathered ``[B, Hk, S, K, D]`` rows.

    ``valid [B, S, K]`` marks real rows; a query with none (and no sink) outputs zeros.
    """
    b, h, s, d = q.shape
    hk = k_sel.shape[1]
    qg = q.reshape(b, hk, h // hk, s, d)
    logits = torch.einsum("bzgsd,bzskd->bzgsk", qg, k_sel) * scale
    logits = logits.masked_fill(~valid.view(b, 1, 1, s, -1), float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(1, hk, h // hk, 1, 1)
        peak = torch.maximum(peak, sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)).detach()
    probs = torch.exp(logits - peak)
    denom = probs.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - peak)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bzgsk,bzskd->bzgsd", probs / denom, v_sel)
    return out.reshape(b, h, s, v_sel.shape[-1])


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query over its selected keys only (DSA's sparse attention).

    Gathers the ``K`` selected K/V rows of each query and computes softmax attention over them:
    ``O(S * K)`` work and memory instead of ``O(S * T)``. Causality (and documents) are already
    in ``indices`` (:func:`indexer_topk`); ``-1`` slots are ignored.

    Args:
        q: Queries ``[B, H, S, D]``.
        k: Keys ``[B, Hk, T, D]``, ``Hk`` dividing ``H`` (``H`` or ``1``: MLA's expanded heads
            or one shared latent head).
        v: Values ``[B, Hk, T, Dv]``.
        indices: ``[B, S, K]`` integer key positions in ``[0, T)``, or ``-1``.
        scale: Softmax scale of ``q . k``.
        sinks: Optional ``[H]`` attention-sink logits (an extra softmax column with no value).

    Returns:
        ``[B, H, S, Dv]`` in ``q``'s dtype; a query whose slots are all ``-1`` (and no sink)
        gets zeros. Differentiable in ``q``, ``k``, ``v`` and ``sinks``.

    Raises:
        TypeError: A non-tensor input.
        ValueError: Shapes that do not match.

    See Also:
        :pt:`torch.nn.functional.scaled_dot_product_attention`: the dense attention this equals
        with the selection turned into a boolean mask.
    """
    routed = _routed("attention")
    if routed is not None:
        return routed.dense(q, k, v, indices, scale=scale, sinks=sinks)  # type: ignore[no-any-return]
    _check_rank("q", q, 4, "[B, H, S, D]")
    _check_rank("k", k, 4, "[B, Hk, T, D]")
    _check_rank("v", v, 4, "[B, Hk, T, Dv]")
    _check_rank("indices", indices, 3, "[B, S, K]")
    b, h, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % hk:
        raise ValueError(
            f"k must be [B={b}, Hk, T, D={d}] with Hk dividing H={h}; got {tuple(k.shape)}"
        )
    if tuple(v.shape[:3]) != (b, hk, t):
        raise ValueError(f"v must be [B, Hk, T, Dv] = [{b}, {hk}, {t}, Dv]; got {tuple(v.shape)}")
    if tuple(indices.shape[:2]) != (b, s):
        raise ValueError(f"indices must be [B={b}, S={s}, K]; got {tuple(indices.shape)}")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be [H={h}]; got {tuple(sinks.shape)}")
    indices = indices.long()
    valid = indices >= 0
    safe = indices.clamp(min=0)
    k_sel, v_sel = _gather_rows(k, safe), _gather_rows(v, safe)
    return _attend_selected(q, k_sel, v_sel, valid, scale, sinks).to(q.dtype)


#: ``expand(rows [N, C]) -> (k [N, Hk, D], v [N, Hk, Dv])``: MLA's up-projection of latent rows.
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _shared_head(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows.unsqueeze(1), rows.unsqueeze(1)


def _expand_rows(expand: Expand | None, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (expand or _shared_head)(rows)
    if k.dim() != 3 or v.dim() != 3 or k.shape[0] != rows.shape[0] or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expand must map rows [N={rows.shape[0]}, C] to k [N, Hk, D] and v [N, Hk, Dv]; "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    return k, v


def _attend_rows(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of ``q [B, H, S, D]`` over rows ``[N, Hk, D]`` picked by ``slots [B, S, K]``."""
    b, _, s, _ = q.shape
    kk = slots.shape[-1]
    hk = k_rows.shape[1]
    k_sel = k_rows.index_select(0, slots.reshape(-1)).view(b, s, kk, hk, -1).permute(0, 3, 1, 2, 4)
    v_sel = v_rows.index_select(0, slots.reshape(-1)).view(b, s, kk, hk, -1).permute(0, 3, 1, 2, 4)
    return _attend_selected(q, k_sel, v_sel, valid, scale, sinks).to(q.dtype)


def _check_latent_inputs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor | None
) -> None:
    _check_rank("q", q, 4, "[B, H, S, D]")
    _check_rank("kv", kv, 3, "[B, T, C]")
    _check_rank("indices", indices, 3, "[B, S, K]")
    b, h, s, _ = q.shape
    if kv.shape[0] != b:
        raise ValueError(f"kv must be [B={b}, T, C]; got {tuple(kv.shape)}")
    if tuple(indices.shape[:2]) != (b, s):
        raise ValueError(f"indices must be [B={b}, S={s}, K]; got {tuple(indices.shape)}")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be [H={h}]; got {tuple(sinks.shape)}")


def sparse_latent_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float,
    expand: Expand | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse attention over compressed (MLA latent) K/V rows, expanded by ``expand``.

    The form of :func:`sparse_attention` that context parallelism shards well: K/V are given as
    one compressed row per position (MLA's normalised latent with its RoPE key part, ``C``
    values), and ``expand`` turns rows into per-head keys and values (MLA's ``kv_b_proj``).
    Under context parallelism only the selected rows travel, then are expanded locally
    (:func:`hp_cp_ep.dsa.context_parallel_sparse_attention`).

    Args:
        q: Queries ``[B, H, S, D]``.
        kv: Compressed rows ``[B, T, C]``.
        indices: ``[B, S, K]`` positions in ``[0, T)`` or ``-1`` (:func:`indexer_topk`).
        scale: Softmax scale.
        expand: ``rows [N, C] -> (k [N, Hk, D], v [N, Hk, Dv])`` with ``Hk`` dividing ``H``;
            ``None`` attends to the rows themselves as one shared head (``k = v = row``, MLA's
            weight-absorbed form, ``D = Dv = C``).
        sinks: Optional ``[H]`` attention-sink logits.

    Returns:
        ``[B, H, S, Dv]``; equal to :func:`sparse_attention` on the expanded K/V.

    Raises:
        TypeError: A non-tensor input.
        ValueError: Shapes that do not match, or ``expand`` returning other shapes.

    See Also:
        :pt:`torch.nn.functional.scaled_dot_product_attention`
    """
    routed = _routed("attention")
    if routed is not None:
        return routed.latent(q, kv, indices, scale=scale, expand=expand, sinks=sinks)  # type: ignore[no-any-return]
    _check_latent_inputs(q, kv, indices, sinks)
    b, t, c = kv.shape
    k_rows, v_rows = _expand_rows(expand, kv.reshape(b * t, c))
    if q.shape[1] % k_rows.shape[1] or q.shape[-1] != k_rows.shape[-1]:
        raise ValueError(
            f"expanded keys [N, Hk={k_rows.shape[1]}, D={k_rows.shape[-1]}] do not fit q "
            f"{tuple(q.shape)} (Hk must divide H, D must match)"
        )
    indices = indices.long()
    valid = indices >= 0
    offsets = (torch.arange(b, device=indices.device) * t).view(b, 1, 1)
    return _attend_rows(q, k_rows, v_rows, indices.clamp(min=0) + offsets, valid, scale, sinks)


def _selected_index_logits(
    index_q: torch.Tensor,
    index_k_sel: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Indexer scores of ``index_q [B, S, Hi, Di]`` at its selected keys ``[B, S, K, Di]``."""
    dots = torch.einsum("bshd,bskd->bshk", index_q.float(), index_k_sel.float())
    logits = torch.einsum("bsh,bshk->bsk", weights.float(), F.relu(dots * softmax_scale))
    return logits.masked_fill(~valid, float("-inf"))


@torch.no_grad()
def _head_summed_probs(
    q: torch.Tensor, k_rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """The main attention's distribution over the selected keys, summed over heads, L1-normed."""
    b, h, s, _ = q.shape
    hk = k_rows.shape[1]
    kk = slots.shape[-1]
    k_sel = k_rows.index_select(0, slots.reshape(-1)).view(b, s, kk, hk, -1).permute(0, 3, 1, 2, 4)
    logits = torch.einsum(
        "bzgsd,bzskd->bzgsk", q.reshape(b, hk, h // hk, s, -1).float(), k_sel.float()
    )
    logits = (logits * scale).masked_fill(~valid.view(b, 1, 1, s, kk), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(1, 2))  # [B, S, K]
    total = probs.sum(dim=-1, keepdim=True)
    return probs / torch.where(total > 0, total, torch.ones_like(total))


def _kl_to_indexer(target: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``KL(target || softmax(logits))`` per query over its valid slots (``0`` with none)."""
    any_valid = valid.any(dim=-1, keepdim=True)
    safe = torch.where(any_valid, logits, torch.zeros_like(logits))
    log_q = torch.log_softmax(safe, dim=-1)
    log_p = torch.log(torch.where(target > 0, target, torch.ones_like(target)))
    terms = torch.where(target > 0, target * (log_p - log_q), torch.zeros_like(target))
    return terms.sum(dim=-1)


def sparse_indexer_loss(
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
    """DSA's sparse-stage indexer loss: per query, KL from the main attention to the indexer.

    Over the selected keys ``S_t`` of every query ``t``: the target is the main attention's
    distribution summed over heads and L1-normalised (computed without gradient), the
    prediction is ``softmax`` of the indexer scores at ``S_t``. Only the indexer inputs get
    gradients (DeepSeek-V3.2 trains the indexer by this loss alone).

    Args:
        index_q: Indexer queries ``[B, S, Hi, Di]``.
        index_k: Indexer keys ``[B, T, Di]``.
        weights: Indexer head weights ``[B, S, Hi]``.
        q: Main attention queries ``[B, H, S, D]``.
        kv: Compressed K/V rows ``[B, T, C]`` (as :func:`sparse_latent_attention`).
        indices: ``[B, S, K]`` the selection (:func:`indexer_topk`).
        softmax_scale: The indexer's scale.
        scale: The main attention's softmax scale.
        expand: Rows to ``(k, v)`` as in :func:`sparse_latent_attention`.

    Returns:
        ``[B, S]`` float32 KL per query (``0`` for a query with no selected key); reduce it as
        the loss needs (mean over tokens in DeepSeek-V3.2).

    Raises:
        TypeError: A non-tensor input.
        ValueError: Shapes that do not match.

    See Also:
        :pt:`torch.nn.functional.kl_div`: the divergence, computed here over each query's
        selected keys.
    """
    routed = _routed("loss")
    if routed is not None:
        return routed(  # type: ignore[no-any-return]
            index_q, index_k, weights, q, kv, indices,
            softmax_scale=softmax_scale, scale=scale, expand=expand,
        )  # fmt: skip
    _check_indexer_inputs(index_q, index_k, weights)
    _check_latent_inputs(q, kv, indices, None)
    b, t, c = kv.shape
    indices = indices.long()
    valid = indices >= 0
    offsets = (torch.arange(b, device=indices.device) * t).view(b, 1, 1)
    slots = indices.clamp(min=0) + offsets
    k_rows, _ = _expand_rows(expand, kv.detach().reshape(b * t, c))
    target = _head_summed_probs(q.detach(), k_rows.detach(), slots, valid, scale)
    ik_sel = index_k.reshape(b * t, -1).index_select(0, slots.reshape(-1))
    ik_sel = ik_sel.view(*indices.shape, -1)
    logits = _selected_index_logits(index_q, ik_sel, weights, softmax_scale, valid)
    return _kl_to_indexer(target, logits, valid)
