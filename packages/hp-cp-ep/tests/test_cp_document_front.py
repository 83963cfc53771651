"""``context_parallel(..., document_ids=...)``: packed documents through the functional front.

The whole-sequence document ids are sharded like the buffers and go with every redirected SDPA
call; output and gradients equal single-device SDPA with the block-causal mask (2 ranks,
load-balanced shards, grouped-query heads, all-gather, Ulysses and the ring), and a mesh of one
rank masks too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hp_cp_ep.cp import context_parallel, shard_sequence
from hp_dtensor.testing import distributed


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 8, generator=gen)
    k, v = (torch.randn(2, 2, 24, 8, generator=gen) for _ in range(2))
    docs = torch.stack([torch.tensor([0] * 5 + [1] * 11 + [2] * 8), torch.tensor([0] * 24)])
    return q, k, v, docs


@pytest.mark.parametrize("mode", ["allgather", "ulysses", "ring"])
@distributed(world_size=2)
def test_document_ids_reach_every_sdpa_call(mode: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q, k, v, docs = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(24, 24).tril().bool()
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    ref.backward(torch.cos(ref.detach()))

    local = [shard_sequence(t, mesh, 2).requires_grad_() for t in (q, k, v)]
    with context_parallel(mesh, mode=mode, document_ids=docs):
        out = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=True)
        out.backward(torch.cos(out.detach()))
    assert torch.equal(docs, _inputs()[3])  # the caller's ids are left whole
    got_all = [out, *(t.grad for t in local)]
    for got, want in zip(got_all, [ref, *(t.grad for t in leaves)], strict=True):
        assert got is not None
        assert want is not None
        torch.testing.assert_close(got.detach(), shard_sequence(want, mesh, 2), atol=1e-5, rtol=0)
    # without the ids the same call is plain causal attention: the ids changed the result
    with context_parallel(mesh, mode=mode):
        causal = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=True)
    assert (causal - out).abs().max() > 1e-3


@distributed(world_size=2)
def test_document_ids_on_a_mesh_of_one_rank_are_masked() -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))["cp"]
    q, k, v, docs = _inputs()
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(24, 24).tril().bool()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with context_parallel(mesh, document_ids=docs):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
