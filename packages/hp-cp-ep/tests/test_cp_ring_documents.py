"""Ring context parallelism with document (packed-sequence) masks.

Oracles: single-device SDPA with the block-causal boolean mask (float64, so 1e-6 is tight), the
all-gather mode on the same shards, and the plain causal ring (one document). Documents of
uneven lengths cross the chunk boundaries, so some ring steps hold query rows that see no key of
the block (their partial must merge as empty) and some blocks hold no same-document pair at all
(skipped: observed by counting kernel calls on each rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp_cp_ep.cp import ContextParallelAttention, shard_sequence
from hp_cp_ep.cp._sdpa_backend import AttentionKernel
from hp_dtensor.testing import distributed

_SEQ = 24
#: Three documents per batch row, different per row, none aligned to a chunk boundary.
_DOCS = torch.stack(
    [torch.tensor([0] * 5 + [1] * 11 + [2] * 8), torch.tensor([0] * 9 + [1] * 3 + [2] * 12)]
)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, _SEQ, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, _SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _block_causal_sdpa(qkv: tuple[torch.Tensor, ...], causal: bool) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in qkv]
    mask = _DOCS[:, None, :, None] == _DOCS[:, None, None, :]
    if causal:
        mask = mask & torch.ones(_SEQ, _SEQ, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    out.backward(torch.cos(out.detach()))
    return [out.detach(), *(t.grad for t in leaves)]  # type: ignore[list-item]


def _sharded_run(
    mesh: DeviceMesh,
    mode: str,
    qkv: tuple[torch.Tensor, ...],
    docs: torch.Tensor | None,
    causal: bool,
    balanced: bool,
) -> list[torch.Tensor]:
    """This rank's output and q/k/v gradients (the gradient of ``sum(cos(out) * out)``)."""
    local = [shard_sequence(t, mesh, 2, load_balance=balanced).requires_grad_() for t in qkv]
    local_docs = None if docs is None else shard_sequence(docs, mesh, 1, load_balance=balanced)
    attn = ContextParallelAttention(mesh, mode=mode, load_balance=balanced)
    out = attn(*local, is_causal=causal, document_ids=local_docs)
    out.backward(torch.cos(out.detach()))
    return [out.detach(), *(t.grad for t in local)]  # type: ignore[list-item]


def _check_against_oracles(mesh: DeviceMesh, mode: str) -> None:
    qkv = _inputs(11)
    for balanced in (True, False):
        for causal in (True, False):
            want = _block_causal_sdpa(qkv, causal)
            got = _sharded_run(mesh, mode, qkv, _DOCS, causal, balanced)
            gathered = _sharded_run(mesh, "allgather", qkv, _DOCS, causal, balanced)
            for g, w, a in zip(got, want, gathered, strict=True):
                expected = shard_sequence(w, mesh, 2, load_balance=balanced)
                torch.testing.assert_close(g, expected, atol=1e-6, rtol=0)
                torch.testing.assert_close(g, a, atol=1e-6, rtol=0)
    # the mask matters: the plain causal ring gives another result
    plain = _sharded_run(mesh, mode, qkv, None, True, True)[0]
    masked = _sharded_run(mesh, mode, qkv, _DOCS, True, True)[0]
    assert (plain - masked).abs().max() > 1e-3


@distributed(world_size=3)
def test_ring_documents_on_3_ranks_match_masked_sdpa_and_allgather() -> None:
    _check_against_oracles(init_device_mesh("cpu", (3,)), "ring")


@distributed(world_size=3)
def test_one_document_is_the_causal_ring_bitwise() -> None:
    mesh = init_device_mesh("cpu", (3,))
    qkv = _inputs(12)
    one_doc = torch.full((2, _SEQ), 4)
    for balanced in (True, False):
        for causal in (True, False):
            plain = _sharded_run(mesh, "ring", qkv, None, causal, balanced)
            documents = _sharded_run(mesh, "ring", qkv, one_doc, causal, balanced)
            for a, b in zip(plain, documents, strict=True):
                assert torch.equal(a, b)


@contextmanager
def _kernel_calls() -> Iterator[dict[str, int]]:
    counts = {"forward": 0, "backward": 0}
    originals = {name: getattr(AttentionKernel, name) for name in counts}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in counts:
            setattr(AttentionKernel, name, counted(name))
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(AttentionKernel, name, fn)


@distributed(world_size=3)
def test_ring_skips_blocks_without_a_shared_document() -> None:
    mesh = init_device_mesh("cpu", (3,))
    rank = mesh.get_local_rank()
    q, k, v = (t[:1] for t in _inputs(13))
    # Plain sharding, chunks of 8: rank r holds positions 8r..8r+7. Documents 0..9, 10..20 and
    # 21..23: rank 2 (documents 1, 2) shares nothing with block 0 (document 0), so its causal
    # ring makes 2 kernel calls instead of 3; rank 1 still needs block 0 (positions 8, 9).
    docs = torch.tensor([[0] * 10 + [1] * 11 + [2] * 3])
    counts = {}
    for name, ids in (("plain", None), ("documents", docs)):
        with _kernel_calls() as calls:
            _sharded_run(mesh, "ring", (q, k, v), ids, True, False)
        counts[name] = dict(calls)
    assert counts["plain"] == {"forward": rank + 1, "backward": rank + 1}
    assert counts["documents"] == {"forward": [1, 2, 2][rank], "backward": [1, 2, 2][rank]}


@distributed(world_size=2)
def test_ring_documents_on_2_ranks_match_masked_sdpa_and_allgather() -> None:
    _check_against_oracles(init_device_mesh("cpu", (2,)), "ring")


@distributed(world_size=4)
def test_hybrid_ring_outer_documents_match_masked_sdpa_and_allgather() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_outer", "cp_ulysses"))
    _check_against_oracles(mesh, "hybrid")
