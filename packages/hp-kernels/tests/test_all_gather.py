"""All-gather copy-in / copy-out: parity with torch FSDP2's sequence, padding, opcheck, compile."""

from __future__ import annotations

import math

import pytest
import torch

import hp_kernels as hk


def _shard(full: torch.Tensor, ws: int, rank: int, dim: int) -> tuple[torch.Tensor, list[int]]:
    """Torch FSDP2's sharding: ``torch.chunk`` (empty chunks for missing ranks) + padded size."""
    chunks = list(torch.chunk(full, ws, dim=dim))
    padded = list(chunks[0].shape)
    while len(chunks) < ws:
        chunks.append(full.new_empty(0))
    return chunks[rank], padded


def _torch_copy_in(shards, splits, ws, rank, dtype):
    """Torch FSDP2's copy-in: padded inputs, ``torch.split`` + ``_foreach_copy_``."""
    total = sum(splits)
    out = torch.zeros(ws * total, dtype=dtype)
    inp = out.narrow(0, rank * total, total)
    padded = []
    for s, n in zip(shards, splits, strict=True):
        p = torch.zeros(n, dtype=s.dtype)
        p[: s.numel()] = s.reshape(-1)
        padded.append(p)
    torch._foreach_copy_(list(torch.split(inp, splits)), padded)
    return inp, out


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_in_matches_torch_sequence(ws: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(ws)
    fulls = [
        torch.randn(7, 3, generator=gen),
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, generator=gen).to(torch.bfloat16),
        torch.randn(1, 1, generator=gen),
    ]
    for rank in range(ws):
        shards, splits = [], []
        for f in fulls:
            s, padded = _shard(f, ws, rank, 0)
            shards.append(s)
            splits.append(math.prod(padded))
        inp, out = hk.all_gather_copy_in(shards, splits, ws, rank, dtype)
        ref_inp, _ = _torch_copy_in(shards, splits, ws, rank, dtype)
        assert out.shape == (ws * sum(splits),)
        assert out.dtype == dtype
        assert inp.data_ptr() == out.data_ptr() + rank * sum(splits) * out.element_size()
        torch.testing.assert_close(inp, ref_inp, rtol=0, atol=0)


def test_copy_in_into_preallocated_buffer_and_errors() -> None:
    a, b = torch.arange(4.0).view(2, 2), torch.arange(3.0)
    buf = torch.full((16,), -1.0)
    inp, out = hk.all_gather_copy_in([a, b], [4, 4], 2, 1, torch.float32, out=buf)
    assert out is buf
    assert buf[:8].eq(-1).all()
    assert inp.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="split size"):
        hk.all_gather_copy_in([a], [3], 2, 0, torch.float32)
    with pytest.raises(ValueError, match="rank"):
        hk.all_gather_copy_in([a], [4], 2, 2, torch.float32)
    with pytest.raises(ValueError, match="input_split_sizes"):
        hk.all_gather_copy_in([a, b], [4], 2, 0, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        hk.all_gather_copy_in([a], [4], 2, 0, torch.float32, out=torch.empty(8, dtype=torch.half))
    with pytest.raises(ValueError, match="elements"):
        hk.all_gather_copy_in([a], [4], 2, 0, torch.float32, out=torch.empty(9))


def _simulate_all_gather(outs: list[torch.Tensor], ws: int) -> torch.Tensor:
    total = outs[0].numel() // ws
    return torch.cat([o.narrow(0, r * total, total) for r, o in enumerate(outs)])


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_round_trip_reconstructs_unsharded_params(ws: int) -> None:
    gen = torch.Generator().manual_seed(10 + ws)
    # (full tensor, shard dim): uneven dim 0, fewer rows than ranks, and an even Shard(1).
    params = [
        (torch.randn(7, 3, generator=gen), 0),
        (torch.randn(2, generator=gen), 0),
        (torch.randn(3, 2 * ws, 2, generator=gen), 1),
        (torch.randn(ws + 1, 4, generator=gen), -1 if ws == 2 else 0),
    ]
    per_rank_out = []
    padded_shapes = []
    for rank in range(ws):
        shards, splits = [], []
        padded_shapes = []
        for full, dim in params:
            s, padded = _shard(full, ws, rank, dim % full.dim())
            shards.append(s)
            splits.append(math.prod(padded))
            padded_shapes.append(padded)
        _, out = hk.all_gather_copy_in(shards, splits, ws, rank, torch.float32)
        per_rank_out.append(out)
    gathered = _simulate_all_gather(per_rank_out, ws)
    splits = [math.prod(p) for p in padded_shapes]
    outs = [torch.empty(ws * n) for n in splits]
    hk.all_gather_copy_out(gathered, splits, ws, outs)
    # Torch's copy-out is split_with_sizes_copy on the [ws, -1] view.
    ref = [torch.empty(ws, n) for n in splits]
    torch.split_with_sizes_copy(gathered.view(ws, -1), splits, dim=1, out=ref)
    for o, r in zip(outs, ref, strict=True):
        assert torch.equal(o, r.view(-1))
    for (full, dim), padded, o in zip(params, padded_shapes, outs, strict=True):
        unsharded = hk.unpadded_views(o, padded, full.shape, dim, ws)
        assert torch.equal(unsharded, full)
        if dim % full.dim() == 0:  # a view, no copy
            assert unsharded.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
        target = torch.empty_like(full)
        assert hk.unpadded_views(o, padded, full.shape, dim, ws, out=target) is target
        assert torch.equal(target, full)


def test_unpadded_views_matches_torch_chunk_cat_for_shard1() -> None:
    ws, padded = 3, [4, 2]
    o = torch.randn(ws * 8)
    chunks = torch.chunk(o.view(ws * 4, 2), ws, dim=0)
    ref = torch.cat(chunks, dim=1)
    assert torch.equal(hk.unpadded_views(o, padded, [4, 6], 1, ws), ref)


def test_copy_out_and_unpadded_errors() -> None:
    with pytest.raises(ValueError, match="elements"):
        hk.all_gather_copy_out(torch.empty(10), [2, 3], 3, [torch.empty(6), torch.empty(9)])
    with pytest.raises(TypeError, match="dtype"):
        hk.all_gather_copy_out(torch.empty(10), [2, 3], 2, [torch.empty(4).half(), torch.empty(6)])
    with pytest.raises(ValueError, match="out\\[1\\]"):
        hk.all_gather_copy_out(torch.empty(10), [2, 3], 2, [torch.empty(4), torch.empty(5)])
    with pytest.raises(ValueError, match="global_shape"):
        hk.unpadded_views(torch.empty(12), [2, 3], [5, 4], 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        hk.unpadded_views(torch.empty(12), [2, 3], [4, 3], 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        hk.all_gather_copy_out(torch.empty(10), [2, 3], 0, [])


def test_opcheck_all_gather_ops() -> None:
    shards = [torch.randn(2, 3), torch.randn(3, dtype=torch.float64)]
    out = torch.zeros(2 * 10)
    torch.library.opcheck(torch.ops.hp_kernels.all_gather_copy_in.default, (shards, [6, 4], 1, out))
    outs = [torch.zeros(12), torch.zeros(8)]
    torch.library.opcheck(
        torch.ops.hp_kernels.all_gather_copy_out.default, (torch.randn(20), [6, 4], 2, outs)
    )


def test_fake_tensor_shapes() -> None:
    with torch._subclasses.fake_tensor.FakeTensorMode():
        inp, out = hk.all_gather_copy_in(
            [torch.empty(5, 3), torch.empty(2)], [15, 3], 4, 2, torch.bfloat16
        )
        assert out.shape == (72,)
        assert inp.shape == (18,)
        assert out.dtype == torch.bfloat16
