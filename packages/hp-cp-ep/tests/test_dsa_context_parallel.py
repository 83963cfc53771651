"""DSA under context parallelism: ring top-k, sparse gather, against one device.

Oracle: :func:`hp_cp_ep.dsa.indexer_topk` and :func:`hp_cp_ep.dsa.sparse_latent_attention` on
the whole sequence (themselves checked against ``transformers`` in ``test_dsa_functional.py``).
Observed besides the numbers: the ring's issue order (each hop issued before the block in hand
is scored), host synchronisations (none in the ring, one per layer for the gather's split
sizes, none in backward) and the bytes of every collective against the module's formula.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import hp_cp_ep.dsa.context_parallel as dsa_cp
from hp_cp_ep.cp import shard_sequence
from hp_cp_ep.cp._comm import RingExchange
from hp_cp_ep.dsa import (
    context_parallel_indexer_topk,
    context_parallel_sparse_attention,
    context_parallel_sparse_indexer_loss,
    indexer_topk,
    plan_sparse_gather,
    sparse_indexer_loss,
    sparse_latent_attention,
)
from hp_dtensor.testing import count_host_syncs, distributed

B, S, HI, DI, H, D, DV, C, TOPK = 2, 24, 2, 8, 2, 6, 5, 10, 5


def _documents() -> torch.Tensor:
    """Packed documents crossing chunk boundaries at every cp in (2, 3, 4); rows differ."""
    row = torch.tensor([0] * 7 + [1] * 10 + [2] * 4 + [3] * 3)
    return torch.stack([row, row.roll(5)])


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "iq": torch.randn(B, S, HI, DI, generator=gen),
        "ik": torch.randn(B, S, DI, generator=gen),
        "w": torch.randn(B, S, HI, generator=gen),
        "q": torch.randn(B, H, S, D, generator=gen),
        "kv": torch.randn(B, S, C, generator=gen),
        "wk": torch.randn(C, H * D, generator=gen) * 0.3,
        "wv": torch.randn(C, H * DV, generator=gen) * 0.3,
        "g": torch.randn(B, H, S, DV, generator=gen),
    }


def _index_args(
    x: dict[str, torch.Tensor], mesh: DeviceMesh, balanced: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    iq, ik, w = (shard_sequence(x[n], mesh, 1, load_balance=balanced) for n in ("iq", "ik", "w"))
    return iq, ik, w


def _expander(wk: torch.Tensor, wv: torch.Tensor) -> Any:
    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (rows @ wk).view(-1, H, D), (rows @ wv).view(-1, H, DV)

    return expand


def _reference(x: dict[str, torch.Tensor], docs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    q, kv, wk, wv = (x[n].clone().requires_grad_() for n in ("q", "kv", "wk", "wv"))
    idx = indexer_topk(x["iq"], x["ik"], x["w"], TOPK, softmax_scale=DI**-0.5, document_ids=docs)
    out = sparse_latent_attention(q, kv, idx, scale=0.4, expand=_expander(wk, wv))
    out.backward(x["g"])  # type: ignore[no-untyped-call]
    iq, ik, w = (x[n].clone().requires_grad_() for n in ("iq", "ik", "w"))
    loss = sparse_indexer_loss(
        iq, ik, w, x["q"], x["kv"], idx, softmax_scale=DI**-0.5, scale=0.4,
        expand=_expander(x["wk"], x["wv"]),
    )  # fmt: skip
    (loss * x["g"][:, 0, :, 0]).sum().backward()  # type: ignore[no-untyped-call]
    grads = {"q": q.grad, "kv": kv.grad, "wk": wk.grad, "wv": wv.grad}
    grads |= {"iq": iq.grad, "ik": ik.grad, "w": w.grad}
    return {
        "idx": idx, "out": out.detach(), "loss": loss.detach(),
        **{n: g for n, g in grads.items() if g is not None},
    }  # fmt: skip


def _check_parity(mesh: DeviceMesh, with_docs: bool, balanced: bool, rotate: str) -> int:
    x = _inputs(11)
    docs = _documents() if with_docs else None
    ref = _reference(x, docs)

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return shard_sequence(t, mesh, dim, load_balance=balanced)

    local_docs = shard(docs, 1) if docs is not None else None
    idx = context_parallel_indexer_topk(
        shard(x["iq"], 1), shard(x["ik"], 1), shard(x["w"], 1), TOPK,
        softmax_scale=DI**-0.5, mesh=mesh, load_balance=balanced, document_ids=local_docs,
        rotate_method=rotate,
    )  # fmt: skip
    assert torch.equal(idx, shard(ref["idx"], 1)), "the merged top-k differs from one device"
    q, kv = shard(x["q"], 2).requires_grad_(), shard(x["kv"], 1).requires_grad_()
    wk, wv = x["wk"].clone().requires_grad_(), x["wv"].clone().requires_grad_()
    out = context_parallel_sparse_attention(
        q, kv, idx, scale=0.4, mesh=mesh, expand=_expander(wk, wv), load_balance=balanced
    )
    out.backward(shard(x["g"], 2))  # type: ignore[no-untyped-call]
    torch.testing.assert_close(out, shard(ref["out"], 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, shard(ref["q"], 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.grad, shard(ref["kv"], 1), rtol=1e-5, atol=1e-5)
    for name, p in (("wk", wk), ("wv", wv)):
        assert p.grad is not None
        dist.all_reduce(p.grad, group=mesh.get_group())  # the CP gradient reduction
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-5)
    # the sparse-stage indexer loss: per-query KL and the indexer's gradients
    iq, ik, w = (t.requires_grad_() for t in _index_args(x, mesh, balanced))
    loss = context_parallel_sparse_indexer_loss(
        iq, ik, w, q.detach(), kv.detach(), idx, softmax_scale=DI**-0.5, scale=0.4, mesh=mesh,
        expand=_expander(x["wk"], x["wv"]), load_balance=balanced,
    )  # fmt: skip
    (loss * shard(x["g"][:, 0, :, 0], 1)).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(loss, shard(ref["loss"], 1), rtol=1e-5, atol=1e-5)
    for name, t in (("iq", iq), ("ik", ik), ("w", w)):
        torch.testing.assert_close(t.grad, shard(ref[name], 1), rtol=1e-5, atol=1e-5, msg=name)
    return int((idx == -1).sum())


def _check_all(world: int) -> list[int]:
    mesh = init_device_mesh("cpu", (world,))
    return [
        _check_parity(mesh, docs, balanced, rotate)
        for docs, balanced, rotate in (
            (False, True, "ring"), (True, True, "ring"), (True, False, "ring"),
            (True, True, "allgather"),
        )
    ]  # fmt: skip


@distributed(world_size=2)
def test_cp2_forward_backward_equal_one_device() -> None:
    padding = _check_all(2)
    if dist.get_rank() == 0:  # topk exceeds the visible context of the first queries: -1 slots
        assert all(p > 0 for p in padding)


@distributed(world_size=3)
def test_cp3_forward_backward_equal_one_device() -> None:
    _check_all(3)


@distributed(world_size=4)
def test_cp4_forward_backward_equal_one_device() -> None:
    _check_all(4)


# ----------------------------------------------------------------------------- overlap order


@contextmanager
def _ring_log() -> Iterator[list[str]]:
    log: list[str] = []
    saved = (RingExchange.start, RingExchange.wait, dsa_cp._score_block)

    def wrap(label: str, fn: Any) -> Any:
        def logged(*args: Any, **kwargs: Any) -> Any:
            log.append(label)
            return fn(*args, **kwargs)

        return logged

    RingExchange.start = wrap("send", saved[0])  # type: ignore[method-assign]
    RingExchange.wait = wrap("wait", saved[1])  # type: ignore[method-assign]
    dsa_cp._score_block = wrap("score", saved[2])
    try:
        yield log
    finally:
        RingExchange.start, RingExchange.wait, dsa_cp._score_block = saved  # type: ignore[method-assign]


@distributed(world_size=3)
def test_each_hop_is_issued_before_the_block_in_hand_is_scored() -> None:
    mesh = init_device_mesh("cpu", (3,))
    x = _inputs(12)
    args = _index_args(x, mesh)
    with _ring_log() as log:
        context_parallel_indexer_topk(*args, TOPK, softmax_scale=0.3, mesh=mesh)
    assert log == ["send", "score", "wait", "send", "score", "wait", "score"]
    with _ring_log() as log:  # contiguous shards: later ranks' blocks are skipped, hops are not
        context_parallel_indexer_topk(
            *_index_args(x, mesh, balanced=False),
            TOPK, softmax_scale=0.3, mesh=mesh, load_balance=False,
        )  # fmt: skip
    rank = mesh.get_local_rank()
    assert log.count("send") == 2
    assert log.count("score") == rank + 1


# ----------------------------------------------------------------------- syncs and bytes


@contextmanager
def _bytes_log() -> Iterator[dict[str, int]]:
    sent: dict[str, int] = {"ring": 0, "a2a": 0, "a2a_calls": 0}
    saved = (dist.batch_isend_irecv, dist.all_to_all_single)

    def batch(ops: list[Any]) -> Any:
        sent["ring"] += sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
        )
        return saved[0](ops)

    def a2a(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent["a2a"] += inp.numel() * inp.element_size()
        sent["a2a_calls"] += 1
        return saved[1](out, inp, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = saved


def _check_syncs_and_bytes(world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    rank = mesh.get_local_rank()
    x, docs = _inputs(13), _documents()
    full_idx = indexer_topk(x["iq"], x["ik"], x["w"], TOPK, softmax_scale=0.3, document_ids=docs)
    args = _index_args(x, mesh)
    local_docs = shard_sequence(docs, mesh, 1)
    with count_host_syncs() as ring_syncs, _bytes_log() as ring_bytes:
        idx = context_parallel_indexer_topk(
            *args, TOPK, softmax_scale=0.3, mesh=mesh, document_ids=local_docs
        )
    s = S // world
    # ring: cp - 1 hops of the local keys (fp32) and document ids (int64)
    assert ring_bytes["ring"] == (world - 1) * B * s * (DI * 4 + 8)
    assert ring_syncs.total == 0, ring_syncs.by_op

    q, kv = shard_sequence(x["q"], mesh, 2).requires_grad_(), shard_sequence(x["kv"], mesh, 1)
    kv.requires_grad_()
    expand = _expander(x["wk"], x["wv"])
    with count_host_syncs() as fwd_syncs, _bytes_log() as fwd_bytes:
        out = context_parallel_sparse_attention(q, kv, idx, scale=0.4, mesh=mesh, expand=expand)
    with count_host_syncs() as bwd_syncs, _bytes_log() as bwd_bytes:
        out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]
    # the formula, from the whole selection: R_j distinct rows of rank j asked by this rank
    chunks = torch.arange(S).chunk(2 * world)
    mine = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    owner_of = torch.empty(S, dtype=torch.long)
    for j in range(world):
        owner_of[torch.cat([chunks[j], chunks[2 * world - 1 - j]])] = j
    asked = [set() for _ in range(world)]  # type: list[set[tuple[int, int]]]
    for b in range(B):
        for p in full_idx[b, mine].flatten().tolist():
            if p >= 0:
                asked[int(owner_of[p])].add((b, p))
    rows = sum(len(a) for a in asked)
    assert fwd_bytes["a2a_calls"] == 3  # counts, row ids, rows
    assert fwd_bytes["a2a"] == world * 8 + rows * 8 + _served(mesh) * C * 4
    assert bwd_bytes["a2a"] == rows * C * 4  # the row gradients go back, nothing else
    assert fwd_syncs.total == 1, fwd_syncs.by_op  # the split sizes, read once
    assert bwd_syncs.total == 0, bwd_syncs.by_op
    plan = plan_sparse_gather(idx, local_len=s, mesh=mesh)
    with count_host_syncs() as planned:
        context_parallel_sparse_attention(
            q, kv, idx, scale=0.4, mesh=mesh, plan=plan, expand=expand
        )
    assert planned.total == 0
    return {"rows": rows, "allgather_rows": world * B * s}


def _served(mesh: DeviceMesh) -> int:
    """Distinct rows of this rank every rank (itself included) asks for."""
    x, docs = _inputs(13), _documents()
    full_idx = indexer_topk(x["iq"], x["ik"], x["w"], TOPK, softmax_scale=0.3, document_ids=docs)
    world, rank = mesh.size(), mesh.get_local_rank()
    chunks = torch.arange(S).chunk(2 * world)
    own = set(torch.cat([chunks[rank], chunks[2 * world - 1 - rank]]).tolist())
    served = 0
    for j in range(world):
        theirs = torch.cat([chunks[j], chunks[2 * world - 1 - j]])
        for b in range(B):
            served += len({p for p in full_idx[b, theirs].flatten().tolist() if p in own})
    return served


@distributed(world_size=3)
def test_syncs_and_bytes_against_the_formula_cp3() -> None:
    got = _check_syncs_and_bytes(3)
    assert got["rows"] < got["allgather_rows"]


@distributed(world_size=2)
def test_syncs_and_bytes_against_the_formula_cp2() -> None:
    _check_syncs_and_bytes(2)


# ---------------------------------------------------------------------------- bad input


@distributed(world_size=2)
def test_unsupported_rotate_method_and_bad_inputs_are_refused() -> None:
    mesh = init_device_mesh("cpu", (2,))
    x = _inputs(14)
    args = _index_args(x, mesh)
    with pytest.raises(ValueError, match=r"rotate_method in .* got 'ulysses'"):
        context_parallel_indexer_topk(
            *args, 4, softmax_scale=1.0, mesh=mesh, rotate_method="ulysses"
        )
    with pytest.raises(ValueError, match="topk must be >= 1; got 0"):
        context_parallel_indexer_topk(*args, 0, softmax_scale=1.0, mesh=mesh)
    iq, ik, w = (a[:, :5] for a in args)
    with pytest.raises(ValueError, match="odd"):
        context_parallel_indexer_topk(iq, ik, w, 4, softmax_scale=1.0, mesh=mesh)
    # topk larger than the whole sequence: every key once, the rest -1
    idx = context_parallel_indexer_topk(*args, 100, softmax_scale=1.0, mesh=mesh)
    assert idx.shape == (B, S // 2, S)
