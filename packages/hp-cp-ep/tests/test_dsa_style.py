"""HyperParallel's class-style DSA context parallelism on a module written as one-device code.

A toy DSA layer (indexer, MLA-like latent rows with an up-projection, sparse attention and the
sparse indexer loss) calls the one-device functions; the styles make them context-parallel.
Oracle: the same module on one device (outputs, loss, input and parameter gradients, 1e-5).
Observed: one host synchronisation per layer forward (the gather plan, shared by the attention
and the loss), none in backward; the async indexer style rings the keys, the sync one gathers.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hp_cp_ep.cp import shard_sequence
from hp_cp_ep.cp._comm import RingExchange
from hp_cp_ep.dsa import (
    AsyncDSAIndexerContextParallel,
    AsyncDSAIndexerLossContextParallel,
    AsyncDSASparseAttentionContextParallel,
    DSAGatherCache,
    DSAIndexerContextParallel,
    DSAIndexerLossContextParallel,
    DSASparseAttentionContextParallel,
    indexer_topk,
    sparse_attention,
    sparse_indexer_loss,
    sparse_latent_attention,
)
from hp_dtensor.testing import check_device_groups, count_host_syncs, distributed

DIM, H, D, DV, C, HI, DI, TOPK, S, B = 16, 2, 6, 5, 8, 2, 4, 5, 24, 2


class _ToyDSA(nn.Module):
    def __init__(self, latent: bool) -> None:
        super().__init__()
        self.latent = latent
        self.wq, self.wkv = nn.Linear(DIM, H * D), nn.Linear(DIM, C)
        self.up_k, self.up_v = nn.Linear(C, H * D), nn.Linear(C, H * DV)
        self.iq, self.ik, self.iw = nn.Linear(DIM, HI * DI), nn.Linear(DIM, DI), nn.Linear(DIM, HI)
        self.o = nn.Linear(H * DV, DIM)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.up_k(rows).view(-1, H, D), self.up_v(rows).view(-1, H, DV)

    def forward(self, x: torch.Tensor, docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, H, D).transpose(1, 2)
        kv = self.wkv(x)
        iq, ik, w = self.iq(x).view(b, s, HI, DI), self.ik(x), self.iw(x)
        idx = indexer_topk(iq, ik, w, TOPK, softmax_scale=DI**-0.5, document_ids=docs)
        if self.latent:
            out = sparse_latent_attention(q, kv, idx, scale=0.4, expand=self.expand)
        else:  # expanded K/V heads, as a model without latent rows would call it
            k, v = self.expand(kv.reshape(b * s, C))
            k, v = k.view(b, s, H, D).transpose(1, 2), v.view(b, s, H, DV).transpose(1, 2)
            out = sparse_attention(q, k, v, idx, scale=0.4)
        loss = sparse_indexer_loss(
            iq, ik, w, q, kv, idx, softmax_scale=DI**-0.5, scale=0.4, expand=self.expand
        )
        return self.o(out.transpose(1, 2).reshape(b, s, -1)), loss


def _documents() -> torch.Tensor:
    row = torch.tensor([0] * 7 + [1] * 10 + [2] * 4 + [3] * 3)
    return torch.stack([row, row.roll(5)])


def _check(latent: bool, asynchronous: bool) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _ToyDSA(latent)
    cp_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, DIM, generator=gen, requires_grad=True)
    g = torch.randn(B, S, DIM, generator=gen)
    docs = _documents()
    out, loss = model(x, docs)
    (out * g).sum().add(loss.mean()).backward()

    if asynchronous:
        styles = [
            AsyncDSAIndexerContextParallel(),
            AsyncDSASparseAttentionContextParallel(),
            AsyncDSAIndexerLossContextParallel(),
        ]
    else:
        cache = DSAGatherCache()
        styles = [
            DSAIndexerContextParallel(),
            DSASparseAttentionContextParallel(gather_cache=cache),
            DSAIndexerLossContextParallel(gather_cache=cache),
        ]
    for style in styles:
        style._apply(cp_model, mesh)
    local_x = shard_sequence(x.detach(), mesh, 1).requires_grad_()
    hops = {"n": 0}
    start = RingExchange.start

    def counted(self: RingExchange, tensors: Sequence[torch.Tensor]) -> None:
        hops["n"] += 1
        start(self, tensors)

    local_docs, local_g = shard_sequence(docs, mesh, 1), shard_sequence(g, mesh, 1)
    RingExchange.start = counted  # type: ignore[method-assign]
    # NCCL's rule checked on gloo: only device tensors reach the CP group. Not with the ring:
    # RingExchange builds its P2POps from dist.isend, which the checker wraps (P2POp refuses).
    checker = check_device_groups(device=torch.device("cpu")) if not asynchronous else None
    try:
        with checker or contextlib.nullcontext() as checking:
            with count_host_syncs() as fwd:
                cp_out, cp_loss = cp_model(local_x, local_docs)
            with count_host_syncs() as bwd:
                # the one-device loss is a mean over B * S queries: each rank's share of it
                local = (cp_out * local_g).sum() + cp_loss.sum() / (B * S)
                local.backward()
    finally:
        RingExchange.start = start  # type: ignore[method-assign]
    if checking is not None:
        assert not checking.violations
        # counts + row ids (the plan, shared) + rows for the attention, latent and indexer-key
        # rows for the loss; backward: the attention's and the indexer keys' row gradients
        assert checking.count("all_to_all_single") == 5 + 2
    n = mesh.size()
    torch.testing.assert_close(cp_out, shard_sequence(out.detach(), mesh, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        cp_loss, shard_sequence(loss.detach(), mesh, 1), rtol=1e-5, atol=1e-5
    )
    assert x.grad is not None
    torch.testing.assert_close(local_x.grad, shard_sequence(x.grad, mesh, 1), rtol=1e-5, atol=1e-5)
    for (name, p), cp_p in zip(model.named_parameters(), cp_model.parameters(), strict=True):
        assert cp_p.grad is not None, name
        dist.all_reduce(cp_p.grad)
        torch.testing.assert_close(cp_p.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    return {"fwd": fwd.total, "bwd": bwd.total, "hops": hops["n"], "n": n, "ops": dict(fwd.by_op)}  # type: ignore[dict-item]


@pytest.mark.parametrize("latent", [True, False])
@distributed(world_size=3)
def test_styles_make_one_device_dsa_code_context_parallel(latent: bool) -> None:
    for asynchronous in (False, True):
        got = _check(latent, asynchronous)
        assert got["fwd"] == 1, got  # the gather plan, shared by the attention and the loss
        assert got["bwd"] == 0
        assert got["hops"] == (got["n"] - 1 if asynchronous else 0)  # ring only when async


def test_styles_refuse_unsupported_rotate_methods_by_name() -> None:
    with pytest.raises(ValueError, match="got 'ulysses'"):
        DSAIndexerContextParallel(rotate_method="ulysses")
    assert "rotate_method='ring'" in repr(AsyncDSAIndexerContextParallel())
    assert "rotate_method='allgather'" in repr(DSAIndexerContextParallel())
