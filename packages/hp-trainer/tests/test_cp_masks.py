"""The trainer's attention under context parallelism takes windows, chunks, prefixes and sinks.

Inside the context-parallel step (``hp_cp_ep.cp.context_parallel``, as
:class:`~hp_trainer.distributed.context_parallel.ContextParallelStep` enters it, with the
batch's document ids), :func:`hp_trainer.models.common.attention.attention` with the layer's
``MaskSpec`` and sinks on this rank's shards equals ``reference_attention`` on the whole
sequence (fp32, 1e-5), forward and backward, the sinks' gradient included; and a decoder
``Attention`` layer with a sliding window (its RoPE table sharded as the trainer shards it) gives
the single-process layer's output and, summed over the CP ranks, its weight gradients. cp 3
(ring, all-gather, Ulysses), load-balanced as the trainer runs it. One warm 3-rank pool, tiny
shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_cp_ep.cp import ContextParallelAttention, context_parallel, shard_sequence
from hp_dtensor.testing import distributed
from hp_trainer.models.common.attention import (
    AttentionMasks,
    MaskSpec,
    attention,
    reference_attention,
)
from hp_trainer.models.common.decoder import Attention, DecoderArgs, precompute_rope

_SEQ = 24
_DOCS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 14 + [1] * 10])
_CASES = {  # rotate method: the layer's mask, with sinks or not
    "ring": (MaskSpec(sliding_window=5), True),
    "allgather": (MaskSpec(chunk_size=8), True),
    "ulysses": (MaskSpec(prefix_length=6), False),
}


def _check_functional(mode: str, spec: MaskSpec, with_sinks: bool) -> None:
    mesh = init_device_mesh("cpu", (3,))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, _SEQ, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(6, generator=gen) if with_sinks else None
    # the oracle: the whole sequence on one device
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    full_spec = MaskSpec(
        documents=True,
        sliding_window=spec.sliding_window,
        chunk_size=spec.chunk_size,
        prefix_length=spec.prefix_length,
    )
    want = reference_attention(*leaves, spec=full_spec, document_ids=_DOCS, sinks=ref_sinks)
    want.backward(torch.cos(want.detach()))
    # the trainer's path: the layer's spec and sinks, masks None, inside the CP step
    local = [shard_sequence(t, mesh, 2).requires_grad_() for t in (q, k, v)]
    cp_sinks = None if sinks is None else sinks.clone().requires_grad_()
    with context_parallel(mesh, mode=mode, document_ids=_DOCS):
        out = attention(*local, spec=spec, masks=None, sinks=cp_sinks)
        out.backward(torch.cos(out.detach()))
    torch.testing.assert_close(out, shard_sequence(want.detach(), mesh, 2), atol=1e-5, rtol=1e-5)
    for got, leaf in zip(local, leaves, strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(
            got.grad, shard_sequence(leaf.grad, mesh, 2), atol=1e-5, rtol=1e-5
        )
    if cp_sinks is not None:
        assert cp_sinks.grad is not None
        assert ref_sinks is not None
        dist.all_reduce(cp_sinks.grad)
        torch.testing.assert_close(cp_sinks.grad, ref_sinks.grad, atol=1e-5, rtol=1e-5)


def _check_layer(mode: str) -> None:
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(5)
    args = DecoderArgs(dim=48, n_layers=1, n_heads=6, n_kv_heads=3, vocab_size=64)
    layer = Attention(args)
    layer.mask_spec = MaskSpec(sliding_window=7)
    rope = precompute_rope(8, _SEQ, 10000.0)
    x = torch.randn(2, _SEQ, 48, generator=torch.Generator().manual_seed(6))
    want = layer(x, rope, masks=AttentionMasks("sdpa", _SEQ, document_ids=_DOCS))
    want.backward(torch.cos(want.detach()))
    want_grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    calls = []
    original = ContextParallelAttention._call

    def counted(self: ContextParallelAttention, *a: object, **kw: object) -> torch.Tensor:
        calls.append(self.mode)
        return original(self, *a, **kw)  # type: ignore[arg-type]

    ContextParallelAttention._call = counted  # type: ignore[method-assign]
    try:
        with context_parallel(mesh, mode=mode, document_ids=_DOCS):
            out = layer(shard_sequence(x, mesh, 1), shard_sequence(rope, mesh, 0), masks=None)
            out.backward(torch.cos(out.detach()))
    finally:
        ContextParallelAttention._call = original  # type: ignore[method-assign]
    assert calls == [mode]  # the window went to the engine (not a dense mask to SDPA)
    torch.testing.assert_close(out, shard_sequence(want.detach(), mesh, 1), atol=1e-5, rtol=1e-5)
    for name, p in layer.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-5, rtol=1e-5)


@distributed(world_size=3)
def test_trainer_attention_takes_masks_and_sinks_under_cp3() -> None:
    for mode, (spec, with_sinks) in _CASES.items():
        _check_functional(mode, spec, with_sinks)
    for mode in ("ring", "ulysses"):
        _check_layer(mode)
