"""Blockwise attention over sequence chunks: which query rows attend which key rows, and how.

The global sequence is cut into equal *chunks* numbered in sequence order. A rank's query block
and every key/value block it meets are lists of chunk ids in ascending order (the engine sorts
them so). For a causal mask, query chunk ``a`` sees key chunk ``b < a`` entirely, its own chunk
``b == a`` through a causal mask, and nothing of ``b > a``; without a mask it sees everything.
:func:`plan_tasks` turns that rule into as few kernel calls as possible, and :func:`run_forward`
/ :func:`run_backward` execute them, merging partial outputs by their log-sum-exp.

Why equal-and-ascending chunk lists need one causal call: the kernel's causal mask compares
*local* row and column indices, and when both sides hold the same chunks in ascending order the
local order is the global order, so the local causal mask is the global one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hp_cp_ep.cp._sdpa_backend import AttentionKernel
from hp_kernels import merge_attention_partials


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` (local indices)."""

    q0: int
    q1: int
    k0: int
    k1: int
    is_causal: bool
    mask: torch.Tensor | None = None


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


def restrict_to_documents(
    tasks: Sequence[BlockTask],
    q_doc: torch.Tensor,
    kv_doc: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
) -> list[BlockTask]:
    """The tasks restricted to query/key pairs of the same document (packed sequences).

    A task whose rows all share one document with its keys is kept as it is (so a single
    document computes exactly the plain causal or full blocks); a task with no same-document
    pair is dropped (no kernel call); any other task gets a boolean mask, same document and, for
    a causal task, key position at or before the query position.

    Args:
        tasks: The block's tasks from :func:`plan_tasks`.
        q_doc: Document ids of the local query rows, ``[Sq]`` or ``[B, Sq]``.
        kv_doc: Document ids of the block's key rows, ``[Sk]`` or ``[B, Sk]``.
        q_pos: Global positions of the query rows, ``[Sq]``.
        kv_pos: Global positions of the key rows, ``[Sk]``.

    Returns:
        The tasks to run; empty when no query row sees any key of the block.
    """
    kept: list[BlockTask] = []
    for t in tasks:
        same = q_doc[..., t.q0 : t.q1, None] == kv_doc[..., None, t.k0 : t.k1]
        if bool(same.all()):
            kept.append(t)
            continue
        if t.is_causal:
            same = same & (q_pos[t.q0 : t.q1, None] >= kv_pos[None, t.k0 : t.k1])
        if not bool(same.any()):
            continue
        mask = same.unsqueeze(-3) if same.dim() == 3 else same[None, None]  # [B or 1, 1, q, k]
        kept.append(BlockTask(t.q0, t.q1, t.k0, t.k1, False, mask))
    return kept


class PartialOutput:
    """Running LSE-merged attention output of the local queries.

    Accumulated in float32, or float64 for float64 inputs (the CPU kernel's backward takes the
    LSE in that dtype).
    """

    def __init__(self, q: torch.Tensor, head_dim_v: int) -> None:
        b, h, s, _ = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        self.out = torch.zeros(b, h, s, head_dim_v, dtype=acc_dtype, device=q.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=acc_dtype, device=q.device)

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


def run_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tasks: Sequence[BlockTask],
    scale: float | None,
    partial: PartialOutput,
) -> list[object]:
    """Run the tasks' forward kernels, merging into ``partial``; returns each call's state."""
    aux = []
    for t in tasks:
        res = kernel.forward(
            q[:, :, t.q0 : t.q1],
            k[:, :, t.k0 : t.k1],
            v[:, :, t.k0 : t.k1],
            is_causal=t.is_causal,
            scale=scale,
            mask=t.mask,
        )
        out, lse = res.out, res.lse
        if t.mask is not None:
            # A row that sees no key of this block must merge as "no contribution": LSE -inf
            # and a finite output (the CPU kernel reports LSE 0 for such rows).
            empty = ~t.mask.any(-1)
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
) -> list[KVGrad]:
    """Run the tasks' backward kernels (with the merged ``out``/``lse``), adding into ``dq``.

    The K/V gradients are added into ``dk``/``dv`` when given; otherwise they are returned, for
    a caller that has no accumulator yet (the ring's arrives from the previous rank).
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
            mask=t.mask,
        )
        dq[:, :, rows] += gq
        if dk is not None and dv is not None:
            add_kv_grads([(cols, gk, gv)], dk, dv)
        else:
            pending.append((cols, gk, gv))
    return pending


def add_kv_grads(grads: Sequence[KVGrad], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add task K/V gradients into the accumulators."""
    for cols, gk, gv in grads:
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
