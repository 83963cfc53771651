"""DeepSeek sparse attention under context parallelism (CP): ring top-k, then a sparse gather.

Queries are sharded by sequence (head-tail load balancing by default, as
:func:`hp_cp_ep.shard_sequence` shards them). Two steps per layer:

1. **Ring top-k** (:func:`context_parallel_indexer_topk`). The indexer keys (``Di`` values per
   position, and the document ids when documents are packed) travel around the CP ring. At each
   step the hop carrying the next block is issued first (``batch_isend_irecv``: the send to the
   next rank and the receive from the previous one posted together, as NCCL needs), then the
   current block is scored against the local queries, its top-k candidates are merged into the
   running top-k, and the hop is awaited. The ranking is a total order (score, then earlier
   position), so the merge of per-block candidates equals the single-device selection of
   :func:`hp_cp_ep.dsa.indexer_topk` exactly. ``cp - 1`` hops, no host synchronisation.
2. **Sparse gather** (:func:`context_parallel_sparse_attention`). Every rank marks which rows
   of each owner its queries selected (a bitmap: each row is requested once however many
   queries chose it), exchanges the per-owner counts (one ``all_to_all_single`` of ``cp``
   integers, read on the host once: the only host synchronisation of the layer), sends the
   requested row ids (an ``all_to_all_single`` with uneven splits) and receives the compressed
   rows (a second one, the owners' answer). The rows are expanded locally (MLA's up-projection)
   and attended to. Backward returns the row gradients with the splits swapped, no new sync.

Bytes per rank and layer (``B`` batch, ``s`` local length, ``Di`` indexer key size, ``C`` row
size, ``R_j`` distinct rows asked of rank ``j``, ``e`` element sizes):
ring ``(cp - 1) * B * s * (Di * e_k [+ 8 with documents])``; counts ``cp * 8`` each way;
indices ``sum_j R_j * 8``; rows ``sum_j R_j * C * e_kv`` forward, the same backward. Since
``R_j <= B * s``, the rows never exceed an all-gather of the latents (``cp * B * s * C``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep.cp._comm import RingExchange
from hp_cp_ep.cp._layout import ChunkLayout
from hp_cp_ep.dsa.functional import (
    Expand,
    _attend_rows,
    _check_indexer_inputs,
    _check_latent_inputs,
    _check_topk,
    _expand_rows,
    _finish,
    _head_summed_probs,
    _kl_to_indexer,
    _rank_candidates,
    _selected_index_logits,
    _visible,
    indexer_scores,
    indexer_topk,
    sparse_indexer_loss,
    sparse_latent_attention,
)
from hp_cp_ep.ep.dispatch import _AllToAllTokens

__all__ = [
    "DSA_ROTATE_METHODS",
    "GatherPlan",
    "context_parallel_indexer_topk",
    "context_parallel_sparse_attention",
    "context_parallel_sparse_indexer_loss",
    "plan_sparse_gather",
]

#: Rotate methods of the DSA ring, with PyTorch's ``"alltoall"`` as an alias of ``"ring"``.
DSA_ROTATE_METHODS = ("ring", "alltoall", "allgather")


def _check_rotate(rotate_method: str) -> str:
    if rotate_method not in DSA_ROTATE_METHODS:
        raise ValueError(
            f"DSA context parallel supports rotate_method in {DSA_ROTATE_METHODS}; got "
            f"{rotate_method!r} (Ulysses would split the indexer's heads, which DSA's top-k "
            f"needs whole)"
        )
    return "allgather" if rotate_method == "allgather" else "ring"


def _mesh_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, int, int]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a 1-D DeviceMesh; got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"DSA context parallel needs a 1-D mesh; got {mesh.ndim}-D {mesh}")
    return mesh.get_group(), mesh.size(), mesh.get_local_rank()


class _Positions:
    """Global positions of every rank's local rows, and the owner of a global position."""

    def __init__(self, cp: int, load_balance: bool, local_len: int) -> None:
        self.layout = ChunkLayout(cp, load_balance)
        per_rank = len(self.layout.chunks_of(0))
        if local_len % per_rank:
            raise ValueError(
                f"a head-tail (load_balance=True) shard holds 2 chunks; its length {local_len} "
                f"is odd"
            )
        self.cp, self.load_balance = cp, load_balance
        self.local_len, self.chunk = local_len, local_len // per_rank

    def of(self, rank: int, device: torch.device) -> torch.Tensor:
        """The global positions of rank ``rank``'s rows, ascending (``[s]``)."""
        base = torch.arange(self.chunk, device=device)
        return torch.cat([base + c * self.chunk for c in self.layout.chunks_of(rank)])

    def owner_row(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank holding global position ``pos`` and its row in that rank's shard."""
        chunk, within = pos // self.chunk, pos % self.chunk
        if not self.load_balance:
            return chunk, within
        tail = chunk >= self.cp
        owner = torch.where(tail, 2 * self.cp - 1 - chunk, chunk)
        return owner, within + tail.long() * self.chunk


def _local_docs(document_ids: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None:
    if document_ids is None:
        return None
    docs = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0).expand(b, -1)
    if tuple(docs.shape) != (b, s):
        raise ValueError(
            f"document_ids must be this rank's shard [B={b}, s={s}] or [s]; got "
            f"{tuple(document_ids.shape)}"
        )
    return docs.contiguous()


def _score_block(
    index_q: torch.Tensor,
    block_k: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    visible: torch.Tensor,
) -> torch.Tensor:
    """One ring step's compute: the masked indexer scores of the local queries on a block."""
    scores = indexer_scores(index_q, block_k, weights, softmax_scale=softmax_scale)
    return scores.masked_fill(~visible, float("-inf"))


@torch.no_grad()
def context_parallel_indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    softmax_scale: float,
    mesh: DeviceMesh,
    load_balance: bool = True,
    document_ids: torch.Tensor | None = None,
    rotate_method: str = "ring",
) -> torch.Tensor:
    """The lightning indexer's top-k over the whole sequence from sequence-sharded inputs.

    Args:
        index_q: This rank's indexer queries ``[B, s, Hi, Di]``.
        index_k: This rank's indexer keys ``[B, s, Di]`` (the same positions).
        weights: This rank's head weights ``[B, s, Hi]``.
        topk: Keys kept per query (``-1`` where fewer are visible).
        softmax_scale: Scale of the dot products.
        mesh: The 1-D context-parallel mesh.
        load_balance: The shards are head-tail (chunks ``r`` and ``2 cp - 1 - r``) as
            :func:`hp_cp_ep.shard_sequence` cuts them; else contiguous.
        document_ids: This rank's shard of the document ids, ``[B, s]`` or ``[s]``.
        rotate_method: ``"ring"`` (or PyTorch's alias ``"alltoall"``): the keys travel around
            the ring, each hop overlapped with the scoring of the block in hand;
            ``"allgather"``: the keys are all-gathered once, then scored block by block.

    Returns:
        int64 ``[B, s, min(topk, cp * s)]`` *global* positions, equal to
        :func:`hp_cp_ep.dsa.indexer_topk` on the whole sequence at this rank's queries.

    Raises:
        TypeError: A non-tensor input, a non-int ``topk`` or a non-mesh ``mesh``.
        ValueError: An unsupported ``rotate_method`` (named), shapes that do not match, a
            multi-dimensional mesh or ``topk < 1``.

    See Also:
        :func:`hp_cp_ep.dsa.indexer_topk`;
        :pt:`torch.distributed.tensor.experimental.context_parallel` (PyTorch's ring of K/V).
    """
    method = _check_rotate(rotate_method)
    _check_topk(topk)
    _check_indexer_inputs(index_q, index_k, weights)
    group, cp, rank = _mesh_group(mesh)
    b, s = index_q.shape[:2]
    if index_k.shape[1] != s:
        raise ValueError(
            f"index_k must hold this rank's {s} positions like index_q; got {index_k.shape[1]}"
        )
    docs = _local_docs(document_ids, b, s)
    if cp == 1:
        return indexer_topk(
            index_q, index_k, weights, topk, softmax_scale=softmax_scale, document_ids=docs
        )
    positions = _Positions(cp, load_balance, s)
    q_pos = positions.of(rank, index_q.device)
    block = [index_k.contiguous()] + ([docs] if docs is not None else [])
    gathered: list[list[torch.Tensor]] = []
    if method == "allgather":
        gathered = _all_gather_blocks(block, group, cp)
    ring = RingExchange(group)
    run: tuple[torch.Tensor, torch.Tensor] | None = None
    src = rank
    for step in range(cp):
        last = step == cp - 1
        if method == "allgather":
            block = gathered[src]
        elif not last:
            ring.start(block)  # the next block is in flight while this one is scored
        k_pos = positions.of(src, index_q.device)
        causal_skip = not load_balance and src > rank  # a later contiguous shard: all invisible
        if not causal_skip:
            visible = _visible(q_pos, k_pos, docs, block[1] if docs is not None else None)
            scores = _score_block(index_q, block[0], weights, softmax_scale, visible)
            cand = _rank_candidates(scores, k_pos.expand_as(scores), topk, keys_sorted=True)
            if run is not None:
                both = (torch.cat([run[0], cand[0]], -1), torch.cat([run[1], cand[1]], -1))
                cand = _rank_candidates(*both, topk, keys_sorted=False)
            run = cand
        if method == "ring" and not last:
            block = ring.wait()
        src = (src - 1) % cp
    assert run is not None  # the diagonal block is never skipped
    top_scores, top_keys = run
    if top_keys.shape[-1] < min(topk, cp * s):  # skipped blocks: pad to the full width
        pad = min(topk, cp * s) - top_keys.shape[-1]
        top_scores = torch.cat([top_scores, top_scores.new_full((b, s, pad), float("-inf"))], -1)
        top_keys = torch.cat([top_keys, top_keys.new_full((b, s, pad), -1)], -1)
    return _finish(top_scores, top_keys)


def _all_gather_blocks(
    block: list[torch.Tensor], group: dist.ProcessGroup, cp: int
) -> list[list[torch.Tensor]]:
    outs = []
    for t in block:
        out = t.new_empty((cp * t.shape[0], *t.shape[1:]))
        dist.all_gather_single(out, t, group=group)
        outs.append(out.chunk(cp))
    return [[o[j] for o in outs] for j in range(cp)]


class GatherPlan(NamedTuple):
    """Which compressed rows a rank fetches from which owner (one DSA layer, one batch).

    Fields: ``send_counts`` (rows asked of each rank, host ints: the one host
    synchronisation), ``recv_counts`` (rows each rank asks of this one, host ints),
    ``request`` (the requested row ids grouped by owner, ``[sum(send_counts)]``), ``asked``
    (this rank's row ids the others request, grouped by requester, ``[sum(recv_counts)]``),
    ``slots``
    (``[B, s, K]``: the received row each selected key reads, ``0`` where invalid) and
    ``valid`` (``[B, s, K]`` bool, ``False`` at ``-1`` slots).

    See Also:
        :pt:`torch.distributed.all_to_all_single`
    """

    send_counts: list[int]
    recv_counts: list[int]
    request: torch.Tensor
    asked: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor


def plan_sparse_gather(
    indices: torch.Tensor, *, local_len: int, mesh: DeviceMesh, load_balance: bool = True
) -> GatherPlan:
    """Plan the sparse gather of the rows ``indices`` selects (one host synchronisation).

    Each owner is asked for every row any local query selected, once. The counts are exchanged
    with one ``all_to_all_single`` of ``cp`` integers and read on the host together (the sizes
    the uneven all-to-alls need), then the row ids with a second one: every gather with the
    plan is then one all-to-all of rows.

    Args:
        indices: ``[B, s, K]`` global positions or ``-1`` (the local queries' selection).
        local_len: ``s``, the rows each rank holds.
        mesh: The 1-D context-parallel mesh.
        load_balance: Head-tail shards (as the indices' owners are laid out).

    Returns:
        The :class:`GatherPlan`; reuse it for every gather of the same selection (rows of
        another tensor, e.g. the indexer keys for its loss) to skip the synchronisation.

    See Also:
        :pt:`torch.distributed.all_to_all_single`: the collective of the gather.
    """
    group, cp, _ = _mesh_group(mesh)
    b = indices.shape[0]
    positions = _Positions(cp, load_balance, local_len)
    indices = indices.long()
    valid = indices >= 0
    owner, row = positions.owner_row(indices.clamp(min=0))
    per_owner = b * local_len
    batch = torch.arange(b, device=indices.device).view(b, 1, 1)
    flat = owner * per_owner + batch * local_len + row  # owner-major request id
    dump = cp * per_owner  # invalid slots write here (dropped)
    need = torch.zeros(dump + 1, dtype=torch.bool, device=indices.device)
    need[torch.where(valid, flat, dump).reshape(-1)] = True
    need = need[:dump]
    send = need.view(cp, per_owner).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    counts = torch.cat([send, recv]).tolist()  # the one host synchronisation of the layer
    send_counts, recv_counts = counts[:cp], counts[cp:]
    total = sum(send_counts)
    wanted = torch.sort((~need).to(torch.uint8), stable=True).indices[:total]  # ascending ids
    slot_of = torch.zeros(dump, dtype=torch.long, device=indices.device)
    slot_of[wanted] = torch.arange(total, device=indices.device)
    slots = torch.where(valid, slot_of[flat.clamp(max=dump - 1)], 0)
    request = wanted % per_owner
    asked = torch.empty(sum(recv_counts), dtype=torch.long, device=indices.device)
    dist.all_to_all_single(
        asked,
        request,
        output_split_sizes=recv_counts,
        input_split_sizes=send_counts,
        group=group,
    )
    return GatherPlan(send_counts, recv_counts, request, asked, slots, valid)


def _gather_rows(rows: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's requested rows of ``rows [B * s, C]`` from their owners (differentiable)."""
    answer = rows.index_select(0, plan.asked)
    return _AllToAllTokens.apply(answer, plan.send_counts, plan.recv_counts, group, None)  # type: ignore[no-untyped-call,no-any-return]


def context_parallel_sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float,
    mesh: DeviceMesh,
    expand: Expand | None = None,
    load_balance: bool = True,
    sinks: torch.Tensor | None = None,
    plan: GatherPlan | None = None,
) -> torch.Tensor:
    """Sparse attention of the local queries over selected rows held by any CP rank.

    Args:
        q: This rank's queries ``[B, H, s, D]``.
        kv: This rank's compressed rows ``[B, s, C]`` (MLA: normalised latent + RoPE key).
        indices: ``[B, s, K]`` global positions or ``-1``
            (:func:`context_parallel_indexer_topk`).
        scale: Softmax scale.
        mesh: The 1-D context-parallel mesh.
        expand: ``rows [N, C] -> (k [N, Hk, D], v [N, Hk, Dv])`` applied to the gathered rows
            on this rank (``None``: one shared head, ``k = v = row``).
        load_balance: Head-tail shards.
        sinks: Optional ``[H]`` attention-sink logits.
        plan: A :class:`GatherPlan` of the same ``indices`` (else made here: one host sync).

    Returns:
        ``[B, H, s, Dv]``, equal to :func:`hp_cp_ep.dsa.sparse_latent_attention` on the whole
        sequence at this rank's queries. Differentiable in ``q``, ``kv``, ``sinks`` and
        ``expand``'s parameters (each rank holds the gradient of the rows it expanded: sum it
        over the CP group as for any parameter under CP).

    Raises:
        TypeError: A non-tensor input or a non-mesh ``mesh``.
        ValueError: Shapes that do not match, or a multi-dimensional mesh.

    See Also:
        :func:`hp_cp_ep.dsa.sparse_latent_attention`;
        :pt:`torch.distributed.all_to_all_single`.
    """
    _check_latent_inputs(q, kv, indices, sinks)
    group, cp, _ = _mesh_group(mesh)
    b, s, c = kv.shape
    if q.shape[2] != s:
        raise ValueError(f"q holds {q.shape[2]} positions and kv {s}: both must be this shard")
    if cp == 1:
        return sparse_latent_attention(q, kv, indices, scale=scale, expand=expand, sinks=sinks)
    if plan is None:
        plan = plan_sparse_gather(indices, local_len=s, mesh=mesh, load_balance=load_balance)
    rows = _gather_rows(kv.reshape(b * s, c), plan, group)
    k_rows, v_rows = _expand_rows(expand, rows)
    return _attend_rows(q, k_rows, v_rows, plan.slots, plan.valid, scale, sinks)


def context_parallel_sparse_indexer_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    scale: float,
    mesh: DeviceMesh,
    expand: Expand | None = None,
    load_balance: bool = True,
    plan: GatherPlan | None = None,
) -> torch.Tensor:
    """:func:`hp_cp_ep.dsa.sparse_indexer_loss` of the local queries under context parallelism.

    The selected indexer keys and compressed rows are fetched from their owners with the same
    sparse gather as :func:`context_parallel_sparse_attention` (pass its ``plan`` to skip the
    host synchronisation); the gradient of the indexer keys goes back to the owners.

    Args:
        index_q: This rank's indexer queries ``[B, s, Hi, Di]``.
        index_k: This rank's indexer keys ``[B, s, Di]``.
        weights: This rank's indexer head weights ``[B, s, Hi]``.
        q: This rank's main queries ``[B, H, s, D]``.
        kv: This rank's compressed rows ``[B, s, C]``.
        indices: ``[B, s, K]`` global positions or ``-1``.
        softmax_scale: The indexer's scale.
        scale: The main attention's scale.
        mesh: The 1-D context-parallel mesh.
        expand: Rows to ``(k, v)``.
        load_balance: Head-tail shards.
        plan: The :class:`GatherPlan` of ``indices`` (else made here: one host sync).

    Returns:
        ``[B, s]`` KL per local query, equal to the one-device loss at these queries.

    Raises:
        TypeError: A non-tensor input or a non-mesh ``mesh``.
        ValueError: Shapes that do not match, or a multi-dimensional mesh.

    See Also:
        :pt:`torch.nn.functional.kl_div`
    """
    _check_indexer_inputs(index_q, index_k, weights)
    _check_latent_inputs(q, kv, indices, None)
    group, cp, _ = _mesh_group(mesh)
    b, s, c = kv.shape
    if cp == 1:
        return sparse_indexer_loss(
            index_q, index_k, weights, q, kv, indices,
            softmax_scale=softmax_scale, scale=scale, expand=expand,
        )  # fmt: skip
    if plan is None:
        plan = plan_sparse_gather(indices, local_len=s, mesh=mesh, load_balance=load_balance)
    with torch.no_grad():
        rows = _gather_rows(kv.detach().reshape(b * s, c), plan, group)
        k_rows, _ = _expand_rows(expand, rows)
    target = _head_summed_probs(q.detach(), k_rows, plan.slots, plan.valid, scale)
    ik_rows = _gather_rows(index_k.reshape(b * s, -1), plan, group)
    ik_sel = ik_rows.index_select(0, plan.slots.reshape(-1)).view(*plan.slots.shape, -1)
    logits = _selected_index_logits(index_q, ik_sel, weights, softmax_scale, plan.valid)
    return _kl_to_indexer(target, logits, plan.valid)
