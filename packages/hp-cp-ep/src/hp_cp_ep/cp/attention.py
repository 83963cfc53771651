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
The ids are gathered once (tiny integer tensors) and a *plan* is made before any attention runs:
for every key/value block the query rows meet, which kernel calls run unmasked, which are
skipped (no same-document pair) and which take a document mask. Making the plan reads two
booleans per kernel call from the device in one transfer: the call's only host synchronisation
(the functional front makes one plan per batch and every layer reuses it). The ring steps,
forward and backward, then run without any host synchronisation, and a query row that sees no
key of a block merges as an empty partial (LSE ``-inf``). Masks are rebuilt from the O(sequence)
ids and positions next to each kernel call, in forward and again in backward; nothing
O(sequence^2) is kept for the backward.

Grouped-query attention: the kernels take the K/V heads as they are (no repetition per block).
Ulysses sends each rank the K/V heads its query heads use: all ``Hkv`` split ``u`` ways when
``Hkv % u == 0``, otherwise each K/V head repeated ``(H / Hkv) / gcd(H / u, H / Hkv)`` times
before the exchange (``u`` heads in all, ``u / Hkv`` of a plain split, when ``H / u`` divides
``H / Hkv``; never the ``H / Hkv`` of repeating K/V to every query head).

Tensors are ``[batch, heads, local_seq, head_dim]`` as for ``F.scaled_dot_product_attention``,
sharded along the sequence by :class:`~hp_cp_ep.cp._layout.ChunkLayout` over the flattened mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from hp_cp_ep._torch_compat import single_device_sdpa
from hp_cp_ep.cp._blocks import (
    BlockTask,
    DocumentMasks,
    PartialOutput,
    add_kv_grads,
    plan_rule_tasks,
    plan_tasks,
    restrict_rule_tasks_to_documents,
    restrict_to_documents,
    run_backward,
    run_forward,
    sink_grad,
)
from hp_cp_ep.cp._comm import RingExchange, gather_seq, heads_to_seq, seq_to_heads
from hp_cp_ep.cp._layout import ChunkLayout
from hp_cp_ep.cp._mask import NONE, MaskRule, mask_rule
from hp_cp_ep.cp._sdpa_backend import AttentionKernel

__all__ = ["CP_MODES", "ContextParallelAttention"]

#: The context-parallel attention modes.
CP_MODES = ("ring", "allgather", "ulysses", "hybrid")


@dataclass(frozen=True)
class _Plan:
    """A batch's attention plan, made before any attention runs (pure data, O(sequence)).

    ``order``: chunk ids of the local rows as stored (after Ulysses); ``q_ids``: the same ids
    sorted, the order attention runs in. ``blocks[j]``: the kernel calls of the local queries
    against key/value block ``j`` (ring rank ``j``'s block, or the one local / all-gathered
    block), whose rows start at ``j * block_rows`` in ``masks``. ``gathered``/``kv_ids``: the
    all-gathered K/V chunk ids as received and sorted (all-gather exchange only).
    ``ring_steps``: how many ring steps run (the blocks of later steps are hidden from every
    rank by the mask: those hops are not sent); 0 for the whole ring.
    """

    order: tuple[int, ...]
    q_ids: tuple[int, ...]
    chunk_len: int
    blocks: tuple[tuple[BlockTask, ...], ...]
    block_rows: int
    masks: DocumentMasks | None = None
    gathered: tuple[int, ...] = ()
    kv_ids: tuple[int, ...] = ()
    ring_steps: int = 0


@dataclass(frozen=True)
class _RingSpec:
    group: ProcessGroup
    size: int
    rank: int
    scale: float | None
    kernel: AttentionKernel
    plan: _Plan

    @property
    def steps(self) -> int:
        """Ring steps run: every rank's, or fewer when the mask hides the later blocks."""
        return self.plan.ring_steps or self.size

    def run_forward(
        self,
        src: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        partial: PartialOutput,
    ) -> list[object]:
        """The local queries against the K/V block of ring rank ``src``."""
        plan = self.plan
        return run_forward(
            self.kernel, q, k, v, plan.blocks[src], self.scale, partial, plan.masks,
            src * plan.block_rows,
        )  # fmt: skip


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        spec: _RingSpec,
    ) -> torch.Tensor:
        exchange = RingExchange(spec.group)
        partial = PartialOutput(q, v.shape[-1], sinks)
        aux: list[list[object]] = []
        k_cur, v_cur = k, v
        steps = spec.steps
        for step in range(steps):
            if step + 1 < steps:
                exchange.start((k_cur, v_cur))  # the next hop flies while this block computes
            aux.append(spec.run_forward((spec.rank - step) % spec.size, q, k_cur, v_cur, partial))
            if step + 1 < steps:
                k_cur, v_cur = exchange.wait()
        out = partial.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, partial.lse, sinks)
        ctx.spec, ctx.aux = spec, aux
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        spec: _RingSpec = ctx.spec
        plan = spec.plan
        dout = dout.contiguous()
        kv_exchange, grad_exchange = RingExchange(spec.group), RingExchange(spec.group, tag=1)
        steps = spec.steps
        # a ring cut short returns each accumulator to its owner, steps - 1 ranks back, at once
        last_exchange = (
            grad_exchange if steps == spec.size else RingExchange(spec.group, 1, shift=1 - steps)
        )
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        k_cur, v_cur = k, v
        dkv: list[torch.Tensor] = []
        for step in range(steps):
            if step + 1 < steps:
                kv_exchange.start((k_cur, v_cur))
            src = (spec.rank - step) % spec.size  # the forward's tasks; masks rebuilt
            grads = run_backward(
                spec.kernel, dout, q, k_cur, v_cur, out, lse, plan.blocks[src], ctx.aux[step],
                spec.scale, dq, masks=plan.masks, kv_offset=src * plan.block_rows,
            )  # fmt: skip
            if step == 0:
                dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
                dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
            else:  # the accumulator for ``src`` the previous rank sent (awaited after compute)
                dk, dv = grad_exchange.wait()
            add_kv_grads(grads, dk, dv)
            del grads
            if step + 1 < steps:
                grad_exchange.start((dk, dv))  # forward it to the rank that holds ``src`` next
            elif steps > 1:
                last_exchange.start((dk, dv))  # back to the owner of ``src``
            else:
                dkv = [dk, dv]
            if step + 1 < steps:
                k_cur, v_cur = kv_exchange.wait()
        if steps > 1:
            dkv = last_exchange.wait()  # the full dK/dV of this rank's own block
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        tasks: Sequence[BlockTask],
        scale: float | None,
        kernel: AttentionKernel,
        masks: DocumentMasks | None,
    ) -> torch.Tensor:
        partial = PartialOutput(q, v.shape[-1], sinks)
        aux = run_forward(kernel, q, k, v, tasks, scale, partial, masks)
        out = partial.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, partial.lse, sinks)
        ctx.tasks, ctx.aux, ctx.scale, ctx.kernel, ctx.masks = tasks, aux, scale, kernel, masks
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in (q, k, v))
        dout = dout.contiguous()
        run_backward(
            ctx.kernel, dout, q, k, v, out, lse, ctx.tasks, ctx.aux, ctx.scale,
            dq, dk, dv, masks=ctx.masks,
        )  # fmt: skip
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def _permute_chunks(
    x: torch.Tensor, have: Sequence[int], want: Sequence[int], chunk_len: int, dim: int = 2
) -> torch.Tensor:
    """``x`` (holding chunks ``have`` along ``dim``) with its chunks in the order ``want``.

    Slices and one concatenation: no index tensor is built (nothing copied from the host).
    """
    if tuple(have) == tuple(want):
        return x
    where = {c: i for i, c in enumerate(have)}
    return torch.cat([x.narrow(dim, where[c] * chunk_len, chunk_len) for c in want], dim=dim)


def _kv_heads_for_ulysses(x: torch.Tensor, heads: int, ulysses: int) -> torch.Tensor:
    """K/V ``[B, Hkv, s, D]`` with the heads every Ulysses rank needs, in rank order.

    Rank ``j`` gets query heads ``[j * H/u, (j + 1) * H/u)``. When ``Hkv % u == 0`` it needs
    ``Hkv / u`` whole K/V heads and ``x`` is split as it is. Otherwise each K/V head is repeated
    ``r = (H / Hkv) / gcd(H / u, H / Hkv)`` times: consecutive runs of ``g' = gcd(H/u, H/Hkv)``
    query heads then share one (repeated) K/V head on every rank (grouped-query attention with
    group ``g'`` after the exchange), and the all-to-all carries ``Hkv * r = H / g'`` heads in
    all instead of ``H``.
    """
    kv = x.shape[1]
    if kv % ulysses == 0:
        return x
    group = heads // kv
    repeat = group // math.gcd(heads // ulysses, group)
    b, _, s, d = x.shape
    return x.unsqueeze(2).expand(b, kv, repeat, s, d).reshape(b, kv * repeat, s, d)


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
        plan_cache: dict[Any, Any] | None = None,
        mask: Any = None,
        sinks: torch.Tensor | None = None,
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
                (packed sequences). Every mode. Planning the blocks for them costs one host
                synchronisation per call (none in the ring steps).
            plan_cache: Keyword-only: a dict the caller keeps (empty at first) for as long as
                ``document_ids`` stay the same, e.g. one batch through every layer: the plan
                made at the first call is reused, so the batch pays one host synchronisation
                and one gather of the ids. Every rank must pass its cache in the same calls.
            mask: Keyword-only: a mask description over global positions, any object with the
                fields ``causal``, ``documents``, ``sliding_window``, ``chunk_size`` and
                ``prefix_length`` (hp-trainer's ``MaskSpec``), used instead of
                ``is_causal``. Every mode, with or without load balancing: blocks the mask
                hides are not computed (decided on the host, no synchronisation), the ring
                stops after the last step any rank sees a key of, and partly visible blocks
                get a mask built next to the kernel. ``documents=True`` needs
                ``document_ids`` (which apply whenever given). A ``sliding_window`` at least
                the sequence long is full causal attention (logged once).
            sinks: Keyword-only: ``[H]`` attention-sink logits (gpt-oss), one per query head,
                added to every query's softmax denominator; differentiable.

        Returns:
            The local shard of the attention output, ``[B, H, s, Dv]``.

        Raises:
            ValueError: Bad shapes, heads not divisible by the Ulysses degree, a local length
                not divisible into the layout's chunks, document ids of the wrong shape, a
                mask it cannot express (a window or prefix without ``causal``, a size that is
                not a positive int, ``documents=True`` without ids, ``is_causal=True`` with a
                non-causal mask) or sinks that are not ``[H]``.
            TypeError: A ``mask`` without the fields above.
        """
        return self._call(
            query, key, value, is_causal, scale, document_ids, plan_cache, mask, sinks
        )

    def _call(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        is_causal: bool,
        scale: float | None,
        document_ids: torch.Tensor | None,
        plans: dict[Any, Any] | None,
        mask: Any = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`__call__`, reusing and filling ``plans`` (a front's per-batch plan cache).

        A front passes one ``plans`` dict for as long as its document ids stay the same (every
        rank calls in the same order, so every rank hits or misses the cache together).
        """
        self._check(query, key, value, document_ids)
        rule, documents = mask_rule(mask, query.shape[2] * self.degree, is_causal=is_causal)
        if documents and document_ids is None:
            raise ValueError(
                "the mask has documents=True but no document_ids were given (pass this rank's "
                "shard of the batch's document ids, or context_parallel(document_ids=...))"
            )
        if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
            raise ValueError(
                f"sinks must be [heads] = [{query.shape[1]}] (one logit per query head); got "
                f"shape {tuple(sinks.shape)}"
            )
        if self.degree == 1 and document_ids is None and rule.plain and sinks is None:
            return single_device_sdpa(
                query, key, value, is_causal=rule.causal, scale=scale,
                enable_gqa=key.shape[1] != query.shape[1],
            )  # fmt: skip
        kernel = AttentionKernel(query.device.type)
        plan_key = (rule, query.shape[2])
        plan = None if plans is None else plans.get(plan_key)
        if plan is None:
            if document_ids is not None:  # masks are built next to the scores: ids go there
                document_ids = document_ids.to(query.device)
            plan = self._plan(query.shape[2], rule, document_ids, query.device)
            if plans is not None:
                plans[plan_key] = plan
        q, k, v = query, key, value
        if self._ulysses_group is not None:
            heads = q.shape[1]
            k, v = (_kv_heads_for_ulysses(t, heads, self.ulysses_size) for t in (k, v))
            q, k, v = seq_to_heads((q, k, v), self._ulysses_group, concurrent=self.concurrent)
            if sinks is not None:  # this rank's heads after the exchange
                h = q.shape[1]
                sinks = sinks[self.ulysses_rank * h : (self.ulysses_rank + 1) * h]
        q, k, v = (_permute_chunks(t, plan.order, plan.q_ids, plan.chunk_len) for t in (q, k, v))
        out = self._outer(q, k, v, sinks, plan, scale, kernel)
        out = _permute_chunks(out, plan.q_ids, plan.order, plan.chunk_len)
        if self._ulysses_group is not None:
            out = heads_to_seq(out, self._ulysses_group)
        return out

    def _plan(
        self,
        local_len: int,
        rule: MaskRule,
        document_ids: torch.Tensor | None,
        device: torch.device,
    ) -> _Plan:
        """The batch's plan: chunk orders, kernel calls per K/V block, document masks' inputs.

        Without documents it is pure host arithmetic. With documents it gathers the ids (one
        all-gather per exchange dimension) and reads the tasks' decisions from the device once
        (:func:`restrict_to_documents`).
        """
        ids = self.layout.chunks_of(self.outer_rank * self.ulysses_size + self.ulysses_rank)
        chunk_len = local_len // len(ids)
        order, docs = ids, document_ids
        if self._ulysses_group is not None:
            order = self._ids_after_ulysses(self.outer_rank)
            if docs is not None:
                docs = _gather_ids(docs, self._ulysses_group)
        q_ids = tuple(sorted(order))
        if docs is not None:
            docs = _permute_chunks(docs, order, q_ids, chunk_len, dim=-1)
        group = self._outer_group
        gathered: tuple[int, ...] = ()
        kv_ids: tuple[int, ...] = ()
        kv_doc = docs
        if group is None or self.outer_size == 1:
            kv_ids_of: tuple[tuple[int, ...], ...] = (q_ids,)
        elif self.exchange == "ring":
            kv_ids_of = tuple(
                tuple(sorted(self._ids_after_ulysses(r))) for r in range(self.outer_size)
            )
            if docs is not None:  # tiny int tensors: gathered once, never sent with K/V hops
                kv_doc = _gather_ids(docs, group)
        else:
            gathered = tuple(
                c for r in range(self.outer_size) for c in sorted(self._ids_after_ulysses(r))
            )
            kv_ids = tuple(sorted(gathered))
            kv_ids_of = (kv_ids,)
            if docs is not None:
                kv_doc = _permute_chunks(_gather_ids(docs, group), gathered, kv_ids, chunk_len, -1)
        block_rows = len(kv_ids_of[0]) * chunk_len
        all_kv = tuple(c for kv in kv_ids_of for c in kv)
        offsets = [j * block_rows for j in range(len(kv_ids_of))]
        masks = None
        ring_steps = 0
        if rule.plain:
            blocks = [plan_tasks(q_ids, kv, chunk_len, rule.causal) for kv in kv_ids_of]
            if docs is not None and kv_doc is not None:
                masks = DocumentMasks(docs, kv_doc, q_ids, all_kv, chunk_len)
                blocks = restrict_to_documents(list(zip(offsets, blocks, strict=True)), masks)
        else:
            blocks = [plan_rule_tasks(q_ids, kv, chunk_len, rule) for kv in kv_ids_of]
            masks = DocumentMasks(docs, kv_doc, q_ids, all_kv, chunk_len, rule, device)
            if docs is not None:
                blocks = restrict_rule_tasks_to_documents(
                    list(zip(offsets, blocks, strict=True)), masks
                )
            if len(kv_ids_of) > 1:
                ring_steps = self._ring_steps(rule, chunk_len, len(kv_ids_of))
        return _Plan(
            order, q_ids, chunk_len, tuple(tuple(b) for b in blocks), block_rows, masks,
            gathered, kv_ids, ring_steps,
        )  # fmt: skip

    def _ring_steps(self, rule: MaskRule, chunk_len: int, size: int) -> int:
        """Ring steps until the last one in which some rank sees a key of its block.

        Host arithmetic over every rank's chunks (the same answer on every rank, so all ranks
        stop together); documents are not consulted (they differ per rank and need the device).
        """
        n = chunk_len
        held = [sorted(self._ids_after_ulysses(r)) for r in range(size)]

        def sees(r: int, step: int) -> bool:
            return any(
                rule.classify(a * n, a * n + n - 1, b * n, b * n + n - 1) != NONE
                for a in held[r]
                for b in held[(r - step) % size]
            )

        last = max((s for s in range(size) for r in range(size) if sees(r, s)), default=0)
        return last + 1

    def _outer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: _Plan,
        scale: float | None,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        group = self._outer_group
        if group is not None and self.outer_size > 1:
            if self.exchange == "ring":
                spec = _RingSpec(group, self.outer_size, self.outer_rank, scale, kernel, plan)
                out: torch.Tensor = _RingAttention.apply(q, k, v, sinks, spec)  # type: ignore[no-untyped-call]
                return out
            k, v = gather_seq((k, v), group, concurrent=self.concurrent)
            k, v = (_permute_chunks(t, plan.gathered, plan.kv_ids, plan.chunk_len) for t in (k, v))
        result: torch.Tensor = _LocalAttention.apply(  # type: ignore[no-untyped-call]
            q, k, v, sinks, plan.blocks[0], scale, kernel, plan.masks
        )
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
