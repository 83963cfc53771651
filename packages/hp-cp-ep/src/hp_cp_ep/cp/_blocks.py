"""Blockwise attention over sequence chunks: which query rows attend which key rows, and how.

The global sequence is cut into equal *chunks* numbered in sequence order. A rank's query block
and every key/value block it meets are lists of chunk ids in ascending order (the engine sorts
them so). For a causal mask, query chunk ``a`` sees key chunk ``b < a`` entirely, its own chunk
``b == a`` through a causal mask, and nothing of ``b > a``; without a mask it sees everything.
:func:`plan_tasks` turns that rule into as few kernel calls as possible, and :func:`run_forward`
/ :func:`run_backward` execute them, merging partial outputs by their log-sum-exp.

Packed documents: :func:`restrict_to_documents` decides once per batch, for every block at once,
which tasks run as they are, which are skipped and which take a document mask; the masks
themselves are rebuilt from O(sequence) document ids and positions (:class:`DocumentMasks`) next
to each kernel call, in forward and again in backward, so no O(sequence^2) tensor is kept
between them.

Why equal-and-ascending chunk lists need one causal call: the kernel's causal mask compares
*local* row and column indices, and when both sides hold the same chunks in ascending order the
local order is the global order, so the local causal mask is the global one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hp_cp_ep.cp._mask import DIAGONAL, NONE, PARTIAL, MaskRule
from hp_cp_ep.cp._sdpa_backend import AttentionKernel
from hp_kernels import merge_attention_partials


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` (local indices).

    ``masked`` tasks take a document mask, built from the batch's :class:`DocumentMasks` next to
    the kernel call in forward and again in backward (never kept in between); ``mask_causal``
    says whether that mask also hides keys after the query's global position.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    is_causal: bool
    masked: bool = False
    mask_causal: bool = False


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers, as half-open ``(start, end)`` pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def plan_tasks(
    q_ids: Sequence[int], kv_ids: Sequence[int], chunk_len: int, is_causal: bool
) -> list[BlockTask]:
    """The kernel calls computing a query block's attention over one key/value block.

    Args:
        q_ids: Chunk ids of the local query rows, ascending.
        kv_ids: Chunk ids of the key/value rows, ascending.
        chunk_len: Rows per chunk.
        is_causal: Whether a query may only see keys at or before its global position.

    Returns:
        The tasks; empty when no query row sees any key of the block.
    """
    nq, nk = len(q_ids), len(kv_ids)
    if not is_causal:
        return [BlockTask(0, nq * chunk_len, 0, nk * chunk_len, False)]
    if list(q_ids) == list(kv_ids):
        return [BlockTask(0, nq * chunk_len, 0, nk * chunk_len, True)]
    # Per query chunk: the runs of fully visible key chunks, and the key chunk on its diagonal.
    rows: list[tuple[tuple[tuple[int, int], ...], int | None]] = []
    for a in q_ids:
        full = tuple(_runs([j for j, b in enumerate(kv_ids) if b < a]))
        diagonal = next((j for j, b in enumerate(kv_ids) if b == a), None)
        rows.append((full, diagonal))
    tasks: list[BlockTask] = []
    start = 0
    for i in range(1, nq + 1):
        # Group consecutive query chunks that see the same key runs (and no diagonal).
        if i < nq and rows[i] == rows[start] and rows[start][1] is None:
            continue
        full, diagonal = rows[start]
        q0, q1 = start * chunk_len, i * chunk_len
        tasks.extend(BlockTask(q0, q1, s * chunk_len, e * chunk_len, False) for s, e in full)
        if diagonal is not None:  # a diagonal row group is a single chunk (ids are unique)
            k0 = diagonal * chunk_len
            tasks.append(BlockTask(q0, q1, k0, k0 + chunk_len, True))
        start = i
    return tasks


def plan_rule_tasks(
    q_ids: Sequence[int], kv_ids: Sequence[int], chunk_len: int, rule: MaskRule
) -> list[BlockTask]:
    """:func:`plan_tasks` for a mask with positional rules (window, chunks, prefix).

    Every query chunk against every key chunk is classified on the host
    (:meth:`~hp_cp_ep.cp._mask.MaskRule.classify`, integer arithmetic): hidden pairs get no
    call, runs of fully visible key chunks one unmasked call, a diagonal chunk that the rule
    leaves causal one causal call, and runs of partly visible key chunks one masked call (its
    mask built from the rule next to the kernel). Consecutive query chunks with the same calls
    (and no diagonal) share them.

    Args:
        q_ids: Chunk ids of the local query rows, ascending.
        kv_ids: Chunk ids of the key/value rows, ascending.
        chunk_len: Rows per chunk.
        rule: The mask's positional rules.

    Returns:
        The tasks; empty when no query row sees any key of the block.
    """
    n = chunk_len
    rows: list[tuple[tuple[int, int, int], ...]] = []
    for a in q_ids:
        kinds = [rule.classify(a * n, a * n + n - 1, b * n, b * n + n - 1) for b in kv_ids]
        row: list[tuple[int, int, int]] = []  # (kind, first key chunk, end key chunk)
        for j, kind in enumerate(kinds):
            if kind == NONE:
                continue
            if row and row[-1][0] == kind and row[-1][2] == j and kind != DIAGONAL:
                row[-1] = (kind, row[-1][1], j + 1)
            else:
                row.append((kind, j, j + 1))
        rows.append(tuple(row))
    tasks: list[BlockTask] = []
    start = 0
    for i in range(1, len(q_ids) + 1):
        diagonal = any(kind == DIAGONAL for kind, _, _ in rows[start])
        if i < len(q_ids) and rows[i] == rows[start] and not diagonal:
            continue
        q0, q1 = start * n, i * n
        for kind, j0, j1 in rows[start]:
            tasks.append(
                BlockTask(q0, q1, j0 * n, j1 * n, kind == DIAGONAL, kind == PARTIAL, False)
            )
        start = i
    return tasks


def chunk_positions(ids: Sequence[int], chunk_len: int, device: torch.device) -> torch.Tensor:
    """Global positions of the rows of chunks ``ids`` (in that order), ``[len(ids) * chunk_len]``.

    Built on the device from ranges (no tensor made from host data, so nothing to copy over).
    """
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in ids])


@dataclass(frozen=True)
class DocumentMasks:
    """What a batch's document masks are built from: O(sequence), never O(sequence^2).

    Document ids of the local query rows (chunks ``q_ids``) and of every key/value row the
    queries meet (chunks ``kv_ids``: the K/V blocks side by side, so block ``j`` of ``n`` rows
    starts at row ``j * n``). A task's boolean mask is rebuilt from these whenever a kernel
    needs it; global positions come from the chunk ids (ranges, built when needed).
    """

    q_doc: torch.Tensor | None
    kv_doc: torch.Tensor | None
    q_ids: tuple[int, ...]
    kv_ids: tuple[int, ...]
    chunk_len: int
    #: Positional rules (window, chunks, prefix) every masked task applies; None: the plain
    #: causal rule of ``mask_causal`` tasks. Without document ids only the rule masks.
    rule: MaskRule | None = None
    device: torch.device | None = None

    def _device(self) -> torch.device:
        if self.q_doc is not None:
            return self.q_doc.device
        assert self.device is not None
        return self.device

    def same_document(self, t: BlockTask, kv_offset: int = 0) -> torch.Tensor:
        """``[..., q, k]`` boolean: query row and key row in the same document."""
        assert self.q_doc is not None
        assert self.kv_doc is not None
        k0, k1 = kv_offset + t.k0, kv_offset + t.k1
        return self.q_doc[..., t.q0 : t.q1, None] == self.kv_doc[..., None, k0:k1]

    def _positions(self, t: BlockTask, kv_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.chunk_len
        k0, k1 = kv_offset + t.k0, kv_offset + t.k1
        q_pos = chunk_positions(self.q_ids[t.q0 // n : t.q1 // n], n, self._device())
        kv_pos = chunk_positions(self.kv_ids[k0 // n : k1 // n], n, self._device())
        return q_pos[:, None], kv_pos[None, :]

    def not_after(self, t: BlockTask, kv_offset: int = 0) -> torch.Tensor:
        """``[q, k]`` boolean: key position at or before the query position."""
        q_pos, kv_pos = self._positions(t, kv_offset)
        return q_pos >= kv_pos

    def rule_visible(self, t: BlockTask, kv_offset: int = 0) -> torch.Tensor:
        """``[q, k]`` boolean: the positional rule lets the query see the key."""
        assert self.rule is not None
        return self.rule.visible(*self._positions(t, kv_offset))

    def mask(self, t: BlockTask, kv_offset: int = 0) -> torch.Tensor:
        """The boolean ``[B or 1, 1, q, k]`` mask of a masked task (``True`` = attend)."""
        if self.rule is not None:
            seen = self.rule_visible(t, kv_offset)
            if self.q_doc is not None:
                seen = self.same_document(t, kv_offset) & seen
        else:
            seen = self.same_document(t, kv_offset)
            if t.mask_causal:
                seen = seen & self.not_after(t, kv_offset)
        return seen.unsqueeze(-3) if seen.dim() == 3 else seen[None, None]


def _chunk_pairs(t: BlockTask, chunk_len: int) -> list[tuple[BlockTask, bool]]:
    """A task cut into chunk-by-chunk sub-blocks, each with whether any of its pairs can be seen.

    A causal task holds the same chunks on both sides in the same order (:func:`plan_tasks`),
    so sub-block ``(i, j)`` is fully visible below the diagonal, causal on it and hidden above.
    """
    pairs = []
    for i, q0 in enumerate(range(t.q0, t.q1, chunk_len)):
        for j, k0 in enumerate(range(t.k0, t.k1, chunk_len)):
            diagonal = t.is_causal and i == j
            sub = BlockTask(q0, q0 + chunk_len, k0, k0 + chunk_len, diagonal)
            pairs.append((sub, not (t.is_causal and j > i)))
    return pairs


def restrict_to_documents(
    blocks: Sequence[tuple[int, Sequence[BlockTask]]], masks: DocumentMasks
) -> list[list[BlockTask]]:
    """Every block's tasks restricted to query/key pairs of the same document (packed sequences).

    A task whose rows all share one document with its keys is kept as it is (so a single
    document computes exactly the plain causal or full blocks); a task with no same-document
    pair is dropped (no kernel call). Any other task is cut into chunk-by-chunk sub-blocks, each
    decided the same way: kept unmasked, dropped, or given a document mask (same document and, on
    a causal diagonal, key position at or before the query position). Masks then never exceed a
    chunk by a chunk, and the blocks inside one document run unmasked (on CUDA: the flash kernel).

    All blocks are decided together, before any attention runs: the decisions are two booleans
    per chunk pair, read by the host in one transfer (the batch's only host synchronisation; the
    ring steps, forward and backward, then run without any).

    Args:
        blocks: ``(kv_offset, tasks)`` per key/value block: the block's first row in
            ``masks.kv_doc`` and its tasks from :func:`plan_tasks`.
        masks: The batch's document ids and positions.

    Returns:
        The tasks to run, per block (a block may be left with none).
    """
    n = masks.chunk_len
    flags = []
    for offset, tasks in blocks:
        for t in tasks:
            for sub, seen in _chunk_pairs(t, n):
                same = masks.same_document(sub, offset)
                visible = same & masks.not_after(sub, offset) if sub.is_causal else same
                flags.append(torch.stack((same.all(), visible.any() & seen)))
    decided = iter(torch.stack(flags).tolist() if flags else [])
    kept: list[list[BlockTask]] = []
    for _, tasks in blocks:
        block: list[BlockTask] = []
        for t in tasks:
            subs = [(sub, seen, *next(decided)) for sub, seen in _chunk_pairs(t, n)]
            if all(all_same for _, _, all_same, _ in subs):
                block.append(t)
            elif len(subs) == 1 and subs[0][3]:
                block.append(BlockTask(t.q0, t.q1, t.k0, t.k1, False, True, t.is_causal))
            elif len(subs) > 1:
                for sub, seen, all_same, any_visible in subs:
                    if seen and all_same:
                        block.append(sub)
                    elif any_visible:
                        block.append(
                            BlockTask(sub.q0, sub.q1, sub.k0, sub.k1, False, True, sub.is_causal)
                        )
        kept.append(block)
    return kept


def restrict_rule_tasks_to_documents(
    blocks: Sequence[tuple[int, Sequence[BlockTask]]], masks: DocumentMasks
) -> list[list[BlockTask]]:
    """:func:`restrict_to_documents` for tasks of :func:`plan_rule_tasks` (``masks.rule`` set).

    Every chunk pair of a task that the rule leaves any pair of is decided on the device (all
    rows in one document with their keys; any pair visible under the rule and the documents);
    the decisions of all blocks are read in one transfer. A task whose pairs all share one
    document runs as planned; otherwise each chunk pair runs in its positional form (one
    document), with a mask of documents and rule (several), or not at all (nothing visible).
    """
    rule, n = masks.rule, masks.chunk_len
    assert rule is not None

    def subs(t: BlockTask, offset: int) -> list[tuple[BlockTask, int]]:
        out = []
        for q0 in range(t.q0, t.q1, n):
            a = masks.q_ids[q0 // n]
            for k0 in range(t.k0, t.k1, n):
                b = masks.kv_ids[(offset + k0) // n]
                kind = rule.classify(a * n, a * n + n - 1, b * n, b * n + n - 1)
                if kind != NONE:
                    out.append((BlockTask(q0, q0 + n, k0, k0 + n, kind == DIAGONAL), kind))
        return out

    planned = [[(t, subs(t, offset)) for t in tasks] for offset, tasks in blocks]
    flags = []
    for (offset, _), block in zip(blocks, planned, strict=True):
        for _, pairs in block:
            for sub, _ in pairs:
                same = masks.same_document(sub, offset)
                visible = same & masks.rule_visible(sub, offset)
                flags.append(torch.stack((same.all(), visible.any())))
    decided = iter(torch.stack(flags).tolist() if flags else [])
    kept: list[list[BlockTask]] = []
    for block in planned:
        out: list[BlockTask] = []
        for t, pairs in block:
            answers = [(sub, kind, *next(decided)) for sub, kind in pairs]
            if all(all_same for _, _, all_same, _ in answers):
                out.append(t)
                continue
            for sub, kind, all_same, any_visible in answers:
                if all_same:
                    out.append(
                        BlockTask(sub.q0, sub.q1, sub.k0, sub.k1, kind == DIAGONAL,
                                  kind == PARTIAL)
                    )  # fmt: skip
                elif any_visible:
                    out.append(BlockTask(sub.q0, sub.q1, sub.k0, sub.k1, False, True))
        kept.append(out)
    return kept


class PartialOutput:
    """Running LSE-merged attention output of the local queries.

    Accumulated in float32, or float64 for float64 inputs (the CPU kernel's backward takes the
    LSE in that dtype).

    With ``sinks`` (one logit per head, gpt-oss's attention sinks) the accumulation starts from
    a partial of output zero and LSE the sink: every row's softmax denominator then holds
    ``exp(sink)`` besides its keys', exactly, and the merged LSE is the one the kernels'
    backward needs (:func:`sink_grad` gives the sinks' gradient).
    """

    def __init__(self, q: torch.Tensor, head_dim_v: int, sinks: torch.Tensor | None = None) -> None:
        b, h, s, _ = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        self.out = torch.zeros(b, h, s, head_dim_v, dtype=acc_dtype, device=q.device)
        if sinks is None:
            self.lse = torch.full((b, h, s), float("-inf"), dtype=acc_dtype, device=q.device)
        else:
            start = sinks.detach().to(acc_dtype).view(1, h, 1)
            self.lse = start.expand(b, h, s).clone()

    def add(self, q0: int, q1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        rows = slice(q0, q1)
        merged_out, merged_lse = merge_attention_partials(
            self.out[:, :, rows],
            self.lse[:, :, rows],
            out.to(self.out.dtype),
            lse.to(self.lse.dtype),
        )
        self.out[:, :, rows] = merged_out
        self.lse[:, :, rows] = merged_lse


def _task_mask(t: BlockTask, masks: DocumentMasks | None, kv_offset: int) -> torch.Tensor | None:
    if not t.masked:
        return None
    if masks is None:
        raise RuntimeError("a masked attention task needs the batch's document masks")
    return masks.mask(t, kv_offset)


def run_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tasks: Sequence[BlockTask],
    scale: float | None,
    partial: PartialOutput,
    masks: DocumentMasks | None = None,
    kv_offset: int = 0,
) -> list[object]:
    """Run the tasks' forward kernels, merging into ``partial``; returns each call's state.

    A masked task's mask is built here from ``masks`` (its key rows start at ``kv_offset`` in
    ``masks.kv_doc``) and dropped after the call.
    """
    aux = []
    for t in tasks:
        mask = _task_mask(t, masks, kv_offset)
        res = kernel.forward(
            q[:, :, t.q0 : t.q1],
            k[:, :, t.k0 : t.k1],
            v[:, :, t.k0 : t.k1],
            is_causal=t.is_causal,
            scale=scale,
            mask=mask,
        )
        out, lse = res.out, res.lse
        if mask is not None:
            # A row that sees no key of this block must merge as "no contribution": LSE -inf
            # and a finite output (the CPU kernel reports LSE 0 for such rows).
            empty = ~mask.any(-1)
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[..., None], 0.0)
        partial.add(t.q0, t.q1, out, lse)
        aux.append(res.aux)
    return aux


#: A key/value block's gradient from one task: (key rows, dK rows, dV rows).
KVGrad = tuple[slice, torch.Tensor, torch.Tensor]


def run_backward(
    kernel: AttentionKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tasks: Sequence[BlockTask],
    aux: Sequence[object],
    scale: float | None,
    dq: torch.Tensor,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    masks: DocumentMasks | None = None,
    kv_offset: int = 0,
) -> list[KVGrad]:
    """Run the tasks' backward kernels (with the merged ``out``/``lse``), adding into ``dq``.

    The K/V gradients are added into ``dk``/``dv`` when given; otherwise they are returned, for
    a caller that has no accumulator yet (the ring's arrives from the previous rank). Masks are
    rebuilt from ``masks`` as in :func:`run_forward`.
    """
    pending: list[KVGrad] = []
    for t, state in zip(tasks, aux, strict=True):
        rows, cols = slice(t.q0, t.q1), slice(t.k0, t.k1)
        gq, gk, gv = kernel.backward(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, cols],
            v[:, :, cols],
            out[:, :, rows],
            lse[:, :, rows],
            state,
            is_causal=t.is_causal,
            scale=scale,
            mask=_task_mask(t, masks, kv_offset),
        )
        dq[:, :, rows] += gq
        if dk is not None and dv is not None:
            add_kv_grads([(cols, gk, gv)], dk, dv)
        else:
            pending.append((cols, gk, gv))
    return pending


def sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sinks: ``-sum(p_sink * rowsum(dout * out))`` over batch and rows.

    ``p_sink = exp(sink - lse)`` is the sink's share of the softmax (its value is zero, so its
    score's gradient is ``p_sink * (0 - rowsum(dout * out))``).
    """
    acc = lse.dtype
    rowsum = (dout.to(acc) * out.to(acc)).sum(-1)
    share = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    return -(share * rowsum).sum((0, 2)).to(sinks.dtype)


def add_kv_grads(grads: Sequence[KVGrad], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add task K/V gradients into the accumulators."""
    for cols, gk, gv in grads:
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
