"""The context-parallel attention engine: ring, all-gather-KV, Ulysses and their 2-D hybrids.

Every mode reduces to one core: blockwise attention of the local query chunks against key/value
chunks, merged by log-sum-exp (:mod:`hp_cp_ep.cp._blocks`). The modes differ in how keys and
values reach the queries:

* ``"ring"``: K/V blocks travel around the context-parallel group by point-to-point sends; the
  next hop is issued before the current block is computed. The backward passes K/V around again
  with a travelling dK/dV accumulator. Memory per rank: two K/V blocks.
* ``"allgather"``: K/V are all-gathered, queries stay local (the Llama 3 paper's CP). Memory:
  the whole K/V.
* ``"ulysses"``: an all-to-all turns the sequence shard with all heads into the whole sequence
  with ``heads / cp`` heads; attention is then local. Needs heads divisible by cp.
* 2-D hybrid: on a 2-D mesh ``(outer, ulysses)`` Ulysses runs over dim 1 and ring (``"hybrid"``
  or ``"ring"``) or all-gather (``"allgather"``) over dim 0.

Every mode takes document ids (packed sequences: a query attends only to keys of its document).
The ring all-gathers them once (tiny integer tensors) and masks each step's block by document and
global position; a block holding no same-document pair is skipped, and a query row that sees no
key of a block merges as an empty partial (LSE ``-inf``).

Tensors are ``[batch, heads, local_seq, head_dim]`` as for ``F.scaled_dot_product_attention``,
sharded along the sequence by :class:`~hp_cp_ep.cp._layout.ChunkLayout` over the flattened mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep._torch_compat import single_device_sdpa
from hp_cp_ep.cp._blocks import (
    BlockTask,
    PartialOutput,
    add_kv_grads,
    plan_tasks,
    restrict_to_documents,
    run_backward,
    run_forward,
)
from hp_cp_ep.cp._comm import RingExchange, gather_seq, heads_to_seq, seq_to_heads
from hp_cp_ep.cp._layout import ChunkLayout
from hp_cp_ep.cp._sdpa_backend import AttentionKernel

__all__ = ["CP_MODES", "ContextParallelAttention"]

#: The context-parallel attention modes.
CP_MODES = ("ring", "allgather", "ulysses", "hybrid")


@dataclass(frozen=True)
class _RingDocuments:
    """Document ids of the local queries and of every ring rank's K/V block (gathered once)."""

    q_doc: torch.Tensor
    q_pos: torch.Tensor
    kv_doc_of: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _RingSpec:
    group: ProcessGroup
    size: int
    rank: int
    q_ids: tuple[int, ...]
    kv_ids_of: tuple[tuple[int, ...], ...]
    chunk_len: int
    is_causal: bool
    scale: float | None
    kernel: AttentionKernel
    documents: _RingDocuments | None = None

    def tasks(self, src: int) -> list[BlockTask]:
        """The kernel calls of the local queries against the K/V block of ring rank ``src``."""
        kv_ids = self.kv_ids_of[src]
        tasks = plan_tasks(self.q_ids, kv_ids, self.chunk_len, self.is_causal)
        if self.documents is None:
            return tasks
        docs = self.documents
        kv_pos = _positions(kv_ids, self.chunk_len, docs.q_pos.device)
        return restrict_to_documents(tasks, docs.q_doc, docs.kv_doc_of[src], docs.q_pos, kv_pos)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: _RingSpec
    ) -> torch.Tensor:
        exchange = RingExchange(spec.group)
        partial = PartialOutput(q, v.shape[-1])
        aux: list[list[object]] = []
        k_cur, v_cur = k, v
        for step in range(spec.size):
            if step + 1 < spec.size:
                exchange.start((k_cur, v_cur))  # the next hop flies while this block computes
            tasks = spec.tasks((spec.rank - step) % spec.size)
            aux.append(run_forward(spec.kernel, q, k_cur, v_cur, tasks, spec.scale, partial))
            if step + 1 < spec.size:
                k_cur, v_cur = exchange.wait()
        out = partial.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, partial.lse)
        ctx.spec, ctx.aux = spec, aux
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        spec: _RingSpec = ctx.spec
        dout = dout.contiguous()
        kv_exchange, grad_exchange = RingExchange(spec.group), RingExchange(spec.group, tag=1)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        k_cur, v_cur = k, v
        dkv: list[torch.Tensor] = []
        for step in range(spec.size):
            if step + 1 < spec.size:
                kv_exchange.start((k_cur, v_cur))
            tasks = spec.tasks((spec.rank - step) % spec.size)  # the forward's, masks included
            grads = run_backward(
                spec.kernel, dout, q, k_cur, v_cur, out, lse, tasks, ctx.aux[step], spec.scale, dq
            )
            if step == 0:
                dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
                dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
            else:  # the accumulator for ``src`` the previous rank sent (awaited after compute)
                dk, dv = grad_exchange.wait()
            add_kv_grads(grads, dk, dv)
            del grads
            if spec.size > 1:
                grad_exchange.start((dk, dv))  # forward it to the rank that holds ``src`` next
            else:
                dkv = [dk, dv]
            if step + 1 < spec.size:
                k_cur, v_cur = kv_exchange.wait()
        if spec.size > 1:
            dkv = grad_exchange.wait()  # the full dK/dV of this rank's own block
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tasks: Sequence[BlockTask],
        scale: float | None,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        partial = PartialOutput(q, v.shape[-1])
        aux = run_forward(kernel, q, k, v, tasks, scale, partial)
        out = partial.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, partial.lse)
        ctx.tasks, ctx.aux, ctx.scale, ctx.kernel = tasks, aux, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in (q, k, v))
        run_backward(
            ctx.kernel, dout.contiguous(), q, k, v, out, lse, ctx.tasks, ctx.aux, ctx.scale,
            dq, dk, dv,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _rows_of(ids: Sequence[int], order: Sequence[int], chunk_len: int, device: Any) -> Any:
    """Row indices that reorder a tensor holding chunks ``ids`` into the chunk order ``order``."""
    where = {c: i for i, c in enumerate(ids)}
    starts = torch.tensor([where[c] * chunk_len for c in order], device=device)
    return (starts[:, None] + torch.arange(chunk_len, device=device)).reshape(-1)


def _reorder(x: torch.Tensor, rows: torch.Tensor | None, dim: int = 2) -> torch.Tensor:
    return x if rows is None else x.index_select(dim, rows)


class ContextParallelAttention:
    """Context-parallel scaled dot-product attention over a device mesh (the engine).

    Call it with this rank's sequence shard of ``query``/``key``/``value``
    (``[batch, heads, local_seq, head_dim]``, sharded as :func:`shard_sequence` does) and it
    returns this rank's shard of ``F.scaled_dot_product_attention`` over the whole sequence;
    gradients flow to the local shards. Dropout and arbitrary dense masks are not supported
    (``ValueError``); grouped-query attention (fewer K/V heads) is.

    Args:
        mesh: The context-parallel mesh: 1-D, or 2-D ``(outer, ulysses)`` for the hybrids.
        mode: ``"ring"``, ``"allgather"``, ``"ulysses"`` (1-D meshes) or ``"hybrid"`` (2-D
            meshes: Ulysses over dim 1, ring over dim 0; ``"ring"``/``"allgather"`` on a 2-D mesh
            pick the exchange over dim 0).
        load_balance: The inputs are head-tail (zigzag) sharded (2 chunks per rank).
        concurrent: Issue the Q/K/V exchanges (Ulysses all-to-alls, all-gathers of K and V) all
            before waiting for any, instead of one after the other (more messages in flight,
            more buffers alive at once). The ring overlaps its hops with compute either way.

    Raises:
        ValueError: Unknown mode, or a mode that does not fit the mesh's dimensions.

    Example:
        >>> # on every rank of a 2-rank group, with q, k, v sharded along dim 2
        >>> # attn = ContextParallelAttention(mesh, mode="ring", load_balance=True)
        >>> # out = attn(q, k, v, is_causal=True)

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's ring attention
        (CUDA kernels only), which this engine serves through :func:`context_parallel`.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        mode: str = "ring",
        load_balance: bool = False,
        concurrent: bool = False,
    ) -> None:
        if mode not in CP_MODES:
            raise ValueError(f"mode must be one of {CP_MODES}, got {mode!r}")
        if mesh.ndim not in (1, 2):
            raise ValueError(f"the context-parallel mesh must be 1-D or 2-D, got {mesh.ndim}-D")
        if mesh.ndim == 1 and mode == "hybrid":
            raise ValueError("mode 'hybrid' needs a 2-D mesh (outer, ulysses); got a 1-D mesh")
        if mesh.ndim == 2 and mode == "ulysses":
            raise ValueError("mode 'ulysses' takes a 1-D mesh; use 'hybrid' on a 2-D mesh")
        self.mesh, self.mode, self.load_balance = mesh, mode, load_balance
        self.concurrent = concurrent
        self.exchange = "allgather" if mode == "allgather" else "ring"
        if mesh.ndim == 2:
            self.outer_size, self.ulysses_size = mesh.size(0), mesh.size(1)
            self.outer_rank, self.ulysses_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
            self._outer_group: ProcessGroup | None = mesh.get_group(0)
            self._ulysses_group: ProcessGroup | None = mesh.get_group(1)
        elif mode == "ulysses":
            self.outer_size, self.outer_rank, self._outer_group = 1, 0, None
            self.ulysses_size, self.ulysses_rank = mesh.size(), mesh.get_local_rank()
            self._ulysses_group = mesh.get_group()
        else:
            self.outer_size, self.outer_rank = mesh.size(), mesh.get_local_rank()
            self._outer_group = mesh.get_group()
            self.ulysses_size, self.ulysses_rank, self._ulysses_group = 1, 0, None
        self.layout = ChunkLayout(self.outer_size * self.ulysses_size, load_balance)

    @property
    def degree(self) -> int:
        """The context-parallel degree (ranks the sequence is split over)."""
        return self.layout.cp

    def _ids_after_ulysses(self, outer_rank: int) -> tuple[int, ...]:
        """Chunk ids an outer rank holds once Ulysses gathered its group's shards (in order)."""
        u = self.ulysses_size
        return tuple(c for j in range(u) for c in self.layout.chunks_of(outer_rank * u + j))

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the local query shard over the whole sequence.

        Args:
            query: ``[B, H, s, D]`` local shard.
            key: ``[B, Hkv, s, D]`` local shard, ``H`` divisible by ``Hkv``.
            value: ``[B, Hkv, s, Dv]`` local shard.
            is_causal: Causal mask over global positions.
            scale: Softmax scale (default ``1 / sqrt(D)``).
            document_ids: ``[s]`` or ``[B, s]`` integer document ids of the local positions
                (sharded like the sequence); a query attends only to keys of its document
                (packed sequences). Every mode.

        Returns:
            The local shard of the attention output, ``[B, H, s, Dv]``.

        Raises:
            ValueError: Bad shapes, heads not divisible by the Ulysses degree, a local length
                not divisible into the layout's chunks, or document ids of the wrong shape.
        """
        self._check(query, key, value, document_ids)
        if document_ids is not None:  # masks are built next to the scores, ids gathered there
            document_ids = document_ids.to(query.device)
        if self.degree == 1 and document_ids is None:
            return single_device_sdpa(
                query, key, value, is_causal=is_causal, scale=scale,
                enable_gqa=key.shape[1] != query.shape[1],
            )  # fmt: skip
        kernel = AttentionKernel(query.device.type)
        heads = query.shape[1]
        ids = self.layout.chunks_of(self.outer_rank * self.ulysses_size + self.ulysses_rank)
        chunk_len = query.shape[2] // len(ids)
        q, k, v = query, key, value
        if self._ulysses_group is not None:
            if k.shape[1] % self.ulysses_size:  # too few K/V heads to split: share them out
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
            q, k, v = seq_to_heads((q, k, v), self._ulysses_group, concurrent=self.concurrent)
            if document_ids is not None:
                document_ids = _gather_ids(document_ids, self._ulysses_group)
            ids = self._ids_after_ulysses(self.outer_rank)
        q_ids = tuple(sorted(ids))
        sort_rows = None if list(ids) == list(q_ids) else _rows_of(ids, q_ids, chunk_len, q.device)
        q, k, v = (_reorder(t, sort_rows) for t in (q, k, v))
        if document_ids is not None:
            document_ids = _reorder(document_ids, sort_rows, dim=-1)
        out = self._outer(q, k, v, q_ids, chunk_len, is_causal, scale, document_ids, kernel)
        if sort_rows is not None:
            out = out.index_select(2, torch.argsort(sort_rows))
        if self._ulysses_group is not None:
            out = heads_to_seq(out, self._ulysses_group)
        return out

    def _outer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_ids: tuple[int, ...],
        chunk_len: int,
        is_causal: bool,
        scale: float | None,
        document_ids: torch.Tensor | None,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        group = self._outer_group
        if group is None or self.outer_size == 1:
            kv_ids, kv_doc = q_ids, document_ids
        elif self.exchange == "ring":
            all_ids = tuple(
                tuple(sorted(self._ids_after_ulysses(r))) for r in range(self.outer_size)
            )
            documents = None
            if document_ids is not None:
                # tiny int tensors: gathered once instead of travelling with every K/V hop
                kv_docs = torch.split(_gather_ids(document_ids, group), q.shape[2], dim=-1)
                q_pos = _positions(q_ids, chunk_len, q.device)
                documents = _RingDocuments(document_ids, q_pos, tuple(kv_docs))
            spec = _RingSpec(
                group, self.outer_size, self.outer_rank, q_ids, all_ids, chunk_len, is_causal,
                scale, kernel, documents,
            )  # fmt: skip
            out: torch.Tensor = _RingAttention.apply(q, k, v, spec)  # type: ignore[no-untyped-call]
            return out
        else:
            k, v = gather_seq((k, v), group, concurrent=self.concurrent)
            gathered = [
                c for r in range(self.outer_size) for c in sorted(self._ids_after_ulysses(r))
            ]
            kv_ids = tuple(sorted(gathered))
            rows = _rows_of(gathered, kv_ids, chunk_len, q.device)
            k, v = _reorder(k, rows), _reorder(v, rows)
            kv_doc = None
            if document_ids is not None:
                kv_doc = _reorder(_gather_ids(document_ids, group), rows, dim=-1)
        if document_ids is not None and kv_doc is not None:
            mask = _document_mask(document_ids, kv_doc, q_ids, kv_ids, chunk_len, is_causal)
            tasks = [BlockTask(0, q.shape[2], 0, k.shape[2], False, mask)]
        else:
            tasks = plan_tasks(q_ids, kv_ids, chunk_len, is_causal)
        result: torch.Tensor = _LocalAttention.apply(q, k, v, tasks, scale, kernel)  # type: ignore[no-untyped-call]
        return result

    def _check(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None,
    ) -> None:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                "query, key and value must be [batch, heads, seq, head_dim]; got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(
                "query, key and value must share batch and (local) sequence length, key and "
                f"value their heads; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if q.shape[1] % k.shape[1]:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
            )
        if self.ulysses_size > 1 and q.shape[1] % self.ulysses_size:
            raise ValueError(
                f"Ulysses splits heads: {q.shape[1]} query heads are not divisible by the "
                f"Ulysses degree {self.ulysses_size}"
            )
        self.layout.check_length(q.shape[2] * self.degree)
        if document_ids is not None and (
            document_ids.shape[-1] != q.shape[2] or document_ids.dim() not in (1, 2)
        ):
            raise ValueError(
                f"document_ids must be [local_seq] or [batch, local_seq] with local_seq = "
                f"{q.shape[2]}; got shape {tuple(document_ids.shape)}"
            )


def _gather_ids(ids: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather integer ids along their last dim (no gradient)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    out = torch.empty((n * ids.shape[0], *ids.shape[1:]), dtype=ids.dtype, device=ids.device)
    dist.all_gather_single(out, ids.contiguous(), group=group)
    return torch.cat(list(out.view(n, *ids.shape).unbind(0)), dim=-1)


def _positions(ids: Sequence[int], chunk_len: int, device: Any) -> torch.Tensor:
    starts = torch.tensor([c * chunk_len for c in ids], device=device)
    return (starts[:, None] + torch.arange(chunk_len, device=device)).reshape(-1)


def _document_mask(
    q_doc: torch.Tensor,
    kv_doc: torch.Tensor,
    q_ids: Sequence[int],
    kv_ids: Sequence[int],
    chunk_len: int,
    is_causal: bool,
) -> torch.Tensor:
    """Boolean ``[B or 1, 1, Sq, Sk]`` mask: same document (and not in the future if causal)."""
    mask = q_doc.unsqueeze(-1) == kv_doc.unsqueeze(-2)
    if is_causal:
        pos_q = _positions(q_ids, chunk_len, q_doc.device)
        pos_k = _positions(kv_ids, chunk_len, q_doc.device)
        mask = mask & (pos_q[:, None] >= pos_k[None, :])
    while mask.dim() < 4:
        mask = mask.unsqueeze(0 if mask.dim() < 3 else 1)
    return mask
