"""Context-parallel attention with mask descriptions: windows, chunks, prefixes, documents, sinks.

Oracle: attention written out on one device (scores, the dense boolean mask built here from the
description's rules, softmax with a sink column), fp32 within 1e-5, forward and the gradients
of q, k, v and the sinks; ring, all-gather and Ulysses at cp 2, 3 and 4, load balancing on and
off, grouped-query K/V. Besides the numbers, what a CPU run cannot feel is counted: host
synchronisations (none without documents, one per batch with them, as for plain causal masks),
kernel calls (blocks a mask hides are never computed) and the ring's point-to-point hops and
bytes (a sliding window stops the ring after the last step any rank sees a key in).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp_cp_ep.cp import (
    ContextParallelAttention,
    context_parallel,
    context_parallel_attention,
    shard_sequence,
)
from hp_cp_ep.cp._mask import DIAGONAL, FULL, NONE, PARTIAL, MaskRule
from hp_cp_ep.cp._sdpa_backend import AttentionKernel
from hp_dtensor.testing import count_host_syncs, distributed

_SEQ, _HEADS, _KV_HEADS = 48, 12, 6


@dataclass(frozen=True)
class _Mask:
    """A mask description with the fields the engine reads (as hp-trainer's MaskSpec)."""

    causal: bool = True
    documents: bool = False
    sliding_window: int | None = None
    chunk_size: int | None = None
    prefix_length: int | None = None


_MASKS = {
    "window5": _Mask(sliding_window=5),
    "window17": _Mask(sliding_window=17),
    "chunk8": _Mask(chunk_size=8),
    "chunk10": _Mask(chunk_size=10),
    "chunk10_noncausal": _Mask(causal=False, chunk_size=10),
    "prefix7": _Mask(prefix_length=7),
    "window9_chunk16": _Mask(sliding_window=9, chunk_size=16),
    "window_docs": _Mask(sliding_window=11, documents=True),
    "chunk_docs": _Mask(chunk_size=12, documents=True),
    "prefix_docs": _Mask(prefix_length=9, documents=True),
}


def _documents() -> torch.Tensor:
    rows = [[0] * 7 + [1] * 20 + [2] * 21, [0] * 15 + [1] * 4 + [2] * 29]
    return torch.tensor(rows)


def _dense(mask: _Mask, docs: torch.Tensor | None) -> torch.Tensor:
    """``[B or 1, 1, S, S]`` boolean mask written from the rules (the oracle's own)."""
    q = torch.arange(_SEQ).view(-1, 1)
    k = torch.arange(_SEQ).view(1, -1)
    seen = torch.ones(_SEQ, _SEQ, dtype=torch.bool)
    if mask.causal:
        allowed = k <= q
        if mask.prefix_length is not None:
            allowed |= k < mask.prefix_length
        seen &= allowed
    if mask.sliding_window is not None:
        seen &= q - k < mask.sliding_window
    if mask.chunk_size is not None:
        seen &= q // mask.chunk_size == k // mask.chunk_size
    seen = seen.view(1, 1, _SEQ, _SEQ)
    if docs is not None:
        seen = seen & (docs[:, None, :, None] == docs[:, None, None, :])
    return seen


def _reference(
    qkv: tuple[torch.Tensor, ...], sinks: torch.Tensor | None, mask: _Mask, docs: Any
) -> list[torch.Tensor]:
    """Output and gradients (of ``sum(cos(out) * out)``) of attention written out."""
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    s = None if sinks is None else sinks.clone().requires_grad_()
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~_dense(mask, docs), float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :_SEQ] @ vv
    out.backward(torch.cos(out.detach()))
    grads = [out.detach(), q.grad, k.grad, v.grad]
    return [*grads, s.grad] if s is not None else grads  # type: ignore[list-item]


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, _HEADS, _SEQ, 8, generator=gen)
    k, v = (torch.randn(2, _KV_HEADS, _SEQ, 8, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(_HEADS, generator=gen)


def _cp_run(
    mesh: DeviceMesh,
    mode: str,
    balanced: bool,
    qkv: tuple[torch.Tensor, ...],
    sinks: torch.Tensor | None,
    mask: _Mask,
    docs: torch.Tensor | None,
) -> list[torch.Tensor]:
    local = [shard_sequence(t, mesh, 2, load_balance=balanced).requires_grad_() for t in qkv]
    s = None if sinks is None else sinks.clone().requires_grad_()
    local_docs = None if docs is None else shard_sequence(docs, mesh, 1, load_balance=balanced)
    attn = ContextParallelAttention(mesh, mode=mode, load_balance=balanced)
    out = attn(*local, mask=mask, sinks=s, document_ids=local_docs)
    out.backward(torch.cos(out.detach()))
    got = [out.detach(), *(t.grad for t in local)]
    if s is not None:
        assert s.grad is not None
        total = s.grad.clone()
        dist.all_reduce(total)  # each rank holds its rows' share of the sinks' gradient
        got.append(total)
    return got  # type: ignore[return-value]


#: the cases run at cp 2 and 4 (cp 3 runs every case)
_SUBSET = (
    "window5",
    "chunk10",
    "window9_chunk16",
    "prefix_docs",
    "causal_sinks",
    "window_docs_sinks",
)


def _check_parity(mesh: DeviceMesh, subset: tuple[str, ...] | None = None) -> None:
    q, k, v, sinks = _inputs(21)
    cases = [(name, m, None) for name, m in _MASKS.items()]
    cases += [
        ("window5_sinks", _MASKS["window5"], sinks),
        ("chunk8_sinks", _MASKS["chunk8"], sinks),
    ]
    cases += [("causal_sinks", _Mask(), sinks), ("window_docs_sinks", _MASKS["window_docs"], sinks)]
    if subset is not None:
        cases = [c for c in cases if c[0] in subset]
        assert len(cases) == len(subset)
    for name, mask, s in cases:
        docs = _documents() if mask.documents else None
        want = _reference((q, k, v), s, mask, docs)
        for mode, balanced in itertools.product(("ring", "allgather", "ulysses"), (True, False)):
            got = _cp_run(mesh, mode, balanced, (q, k, v), s, mask, docs)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                expected = w if i == 4 else shard_sequence(w, mesh, 2, load_balance=balanced)
                torch.testing.assert_close(
                    g,
                    expected,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=f"{name} {mode} balanced={balanced} output/grad {i}",
                )
    # the rules matter: a window changes the output
    plain = _reference((q, k, v), None, _Mask(), None)[0]
    assert (plain - _reference((q, k, v), None, _MASKS["window5"], None)[0]).abs().max() > 1e-2


@distributed(world_size=2)
def test_masks_match_reference_cp2() -> None:
    _check_parity(init_device_mesh("cpu", (2,)), _SUBSET)


@distributed(world_size=3)
def test_masks_match_reference_cp3() -> None:
    _check_parity(init_device_mesh("cpu", (3,)))


@distributed(world_size=4)
def test_masks_match_reference_cp4() -> None:
    _check_parity(init_device_mesh("cpu", (4,)), _SUBSET)


def test_rule_classification_matches_the_elementwise_rule() -> None:
    """The host's rectangle answers agree with the elementwise rule on every rectangle tried."""
    rng = random.Random(3)
    rules = [
        MaskRule(sliding_window=w, chunk_size=c, prefix_length=p)
        for w in (None, 1, 3, 8)
        for c in (None, 2, 5, 16)
        for p in (None, 1, 6)
    ] + [MaskRule(causal=False, chunk_size=c) for c in (None, 3, 7)]
    pos = torch.arange(40)
    for rule in rules:
        dense = rule.visible(pos.view(-1, 1), pos.view(1, -1))
        for _ in range(60):
            q0, k0 = rng.randrange(36), rng.randrange(36)
            n = rng.randrange(1, 40 - max(q0, k0))
            if rng.random() < 0.3:
                k0 = q0
            block = dense[q0 : q0 + n, k0 : k0 + n]
            kind = rule.classify(q0, q0 + n - 1, k0, k0 + n - 1)
            causal = torch.arange(n).view(-1, 1) >= torch.arange(n).view(1, -1)
            want = (
                NONE if not block.any()
                else FULL if block.all()
                else DIAGONAL if q0 == k0 and torch.equal(block, causal)
                else PARTIAL
            )  # fmt: skip
            assert kind == want, (rule, q0, k0, n, kind, want)


@contextmanager
def _traffic() -> Iterator[Counter[str]]:
    """Point-to-point hops and bytes sent, and attention kernel calls, on this rank."""
    counts: Counter[str] = Counter()
    original_p2p = dist.batch_isend_irecv
    originals = {name: getattr(AttentionKernel, name) for name in ("forward", "backward")}

    def p2p(ops: list[Any]) -> Any:
        counts["hops"] += 1
        for op in ops:
            if op.op is dist.isend:
                counts["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return original_p2p(ops)

    def kernel(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        dist.batch_isend_irecv = p2p
        for name in originals:
            setattr(AttentionKernel, name, kernel(name))
        yield counts
    finally:
        dist.batch_isend_irecv = original_p2p
        for name, fn in originals.items():
            setattr(AttentionKernel, name, fn)


def _ring_traffic(mesh: DeviceMesh, mask: _Mask | None, balanced: bool) -> Counter[str]:
    q, k, v, _ = _inputs(22)
    local = [shard_sequence(t, mesh, 2, load_balance=balanced).requires_grad_() for t in (q, k, v)]
    attn = ContextParallelAttention(mesh, mode="ring", load_balance=balanced)
    with _traffic() as counts:
        out = attn(*local, is_causal=True) if mask is None else attn(*local, mask=mask)
        counts["forward_hops"] = counts["hops"]
        out.backward(torch.ones_like(out))
    return counts


@distributed(world_size=4)
def test_sliding_window_skips_whole_ring_steps_cp4() -> None:
    mesh = init_device_mesh("cpu", (4,))
    kv_bytes = 2 * (2 * _KV_HEADS * (_SEQ // 4) * 8 * 4)  # one K/V block hop, fp32
    causal = _ring_traffic(mesh, None, False)
    # chunk 12 rows per rank: a window of 12 reaches the previous rank's block and no further
    windowed = _ring_traffic(mesh, _Mask(sliding_window=12), False)
    # forward: 3 hops of K/V in the causal ring, 1 with the window; backward: 3 K/V hops and
    # 3 dK/dV hops, against 1 K/V hop and 1 dK/dV hop home
    # (the dK/dV accumulators travel one hop per step to get home: 4 in the causal ring, 2 with
    # the window: one to the next rank, one straight back to the owner)
    assert (causal["forward_hops"], causal["hops"]) == (3, 10)
    assert (windowed["forward_hops"], windowed["hops"]) == (1, 4)
    assert causal["bytes"] == 10 * kv_bytes
    assert windowed["bytes"] == 4 * kv_bytes
    # and the hidden blocks are not computed: rank 0 has one causal diagonal call, the others
    # that and one masked call against the previous rank's block
    assert windowed["forward"] == (2 if dist.get_rank() else 1)
    assert windowed["backward"] == windowed["forward"]
    # a window wider than the ring's reach runs every step
    assert _ring_traffic(mesh, _Mask(sliding_window=40), False)["forward_hops"] == 3
    # load balanced (chunks r and 7 - r of 6 rows), a window of 6: chunk c sees chunks c and
    # c - 1; rank 0's chunk 7 sees rank 1's chunk 6 at step 3, so every step runs
    assert _ring_traffic(mesh, _Mask(sliding_window=6), True)["forward_hops"] == 3


def _window_syncs(mesh: DeviceMesh, mode: str, docs: torch.Tensor | None) -> tuple[int, int]:
    q, k, v, sinks = _inputs(23)
    local = [shard_sequence(t, mesh, 2).requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_()
    local_docs = None if docs is None else shard_sequence(docs, mesh, 1)
    attn = ContextParallelAttention(mesh, mode=mode, load_balance=True)
    mask = _Mask(sliding_window=11, chunk_size=20, documents=docs is not None)
    with count_host_syncs() as forward:
        out = attn(*local, mask=mask, sinks=s, document_ids=local_docs)
    with count_host_syncs() as backward:
        out.sum().backward()
    return forward.total, backward.total


def _check_syncs(mesh: DeviceMesh) -> None:
    for mode in ("ring", "allgather", "ulysses"):
        assert _window_syncs(mesh, mode, None) == (0, 0), mode
        # the documents' plan: one read before any attention runs, none in the ring steps
        assert _window_syncs(mesh, mode, _documents()) == (1, 0), mode


@distributed(world_size=2)
def test_masks_cost_no_host_sync_per_ring_step_cp2() -> None:
    _check_syncs(init_device_mesh("cpu", (2,)))


@distributed(world_size=3)
def test_masks_cost_no_host_sync_per_ring_step_cp3() -> None:
    _check_syncs(init_device_mesh("cpu", (3,)))


def _layers(x: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):  # alternating sliding-window and full layers, as gpt-oss
        mask = _Mask(sliding_window=7) if i % 2 == 0 else _Mask()
        out = context_parallel_attention(x, kv, kv, mask=mask, sinks=sinks)
        assert out is not None
        x = out
    return x


@distributed(world_size=3)
def test_functional_front_takes_mask_descriptions_one_plan_per_mask() -> None:
    mesh = init_device_mesh("cpu", (3,))
    q, k, _, sinks = _inputs(24)
    docs = _documents()
    assert context_parallel_attention(q, k, k, mask=_Mask()) is None  # outside: not CP
    totals, outs = {}, {}
    for layers in (2, 4):
        x, kv = (shard_sequence(t, mesh, 2).requires_grad_() for t in (q, k))
        with count_host_syncs() as syncs, context_parallel(mesh, mode="ring", document_ids=docs):
            out = _layers(x, kv, sinks, layers)
            out.sum().backward()
        totals[layers], outs[layers] = syncs.total, out.detach()
    # one plan per mask kind and batch (two kinds), however many layers attend
    assert totals == {2: 2, 4: 2}
    # equal to the written-out attention, layer after layer
    x = q
    for i in range(4):
        mask = _Mask(sliding_window=7, documents=True) if i % 2 == 0 else _Mask(documents=True)
        x = _reference((x, k, k), sinks, mask, docs)[0]
    torch.testing.assert_close(outs[4], shard_sequence(x, mesh, 2), atol=1e-5, rtol=1e-5)


@distributed(world_size=2)
def test_bad_masks_are_refused_naming_the_values() -> None:
    mesh = init_device_mesh("cpu", (2,))
    q, k, v, sinks = _inputs(25)
    local = [shard_sequence(t, mesh, 2) for t in (q, k, v)]
    attn = ContextParallelAttention(mesh, mode="ring", load_balance=True)

    @dataclass(frozen=True)
    class NoChunks:
        causal: bool = True
        documents: bool = False
        sliding_window: int | None = None

    with pytest.raises(TypeError, match="NoChunks lacks chunk_size, prefix_length"):
        attn(*local, mask=NoChunks())
    with pytest.raises(ValueError, match="causal=False, sliding_window=4"):
        attn(*local, mask=_Mask(causal=False, sliding_window=4))
    with pytest.raises(ValueError, match=r"mask.chunk_size must be a positive int or None, got 0"):
        attn(*local, mask=_Mask(chunk_size=0))
    with pytest.raises(ValueError, match="documents=True but no document_ids"):
        attn(*local, mask=_Mask(documents=True))
    with pytest.raises(ValueError, match=r"sinks must be \[heads\] = \[12\].*\(6,\)"):
        attn(*local, mask=_Mask(), sinks=sinks[:6])
    with pytest.raises(ValueError, match="is_causal=True contradicts"):
        attn(*local, is_causal=True, mask=_Mask(causal=False))
    # a window longer than the sequence is full causal attention, said once
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("hp_cp_ep.cp._mask")
    logger.addHandler(handler)
    try:
        wide = [attn(*local, mask=_Mask(sliding_window=_SEQ + 100)) for _ in range(2)]
    finally:
        logger.removeHandler(handler)
    causal = attn(*local, is_causal=True)
    assert all(torch.equal(w, causal) for w in wide)
    assert len(records) == 1
    assert "148 >= sequence length 48" in records[0].getMessage()
