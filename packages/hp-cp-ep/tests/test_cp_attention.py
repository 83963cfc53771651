"""Parity of every context-parallel attention mode with single-device SDPA on the full sequence.

The global q/k/v and upstream gradient come from one seed (the same *global* tensors on every
rank), so each rank's shard holds different data. Each rank checks its shard of the output and of
the q/k/v gradients against ``F.scaled_dot_product_attention`` run on the whole sequence in one
process (fp32: ``rtol=atol=1e-5``). bf16's documented tolerance: against the fp32 reference, the
largest error of a CP shard is at most twice that of single-device bf16 SDPA plus 5e-3 (CP
accumulates its merges in fp32; the measured errors are about equal, ~1e-2 at these sizes).
One job per (world size, mode) loops over the causal / load-balanced / GQA cases.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hp_cp_ep.cp import ContextParallelAttention, shard_sequence
from hp_dtensor.testing import distributed

B, H, S, D = 2, 12, 24, 8


def _global_inputs(kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1234 + kv_heads)
    q = torch.randn(B, H, S, D, generator=gen)
    k = torch.randn(B, kv_heads, S, D, generator=gen)
    v = torch.randn(B, kv_heads, S, D, generator=gen)
    dout = torch.randn(B, H, S, D, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    scale: float | None,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Single-device SDPA output and q/k/v gradients on the whole sequence, in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(dout.to(dtype))
    assert q.grad is not None
    assert k.grad is not None
    assert v.grad is not None
    return [out.detach(), q.grad, k.grad, v.grad]


def _check_mode(mode: str, mesh_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Run all causal x load-balance x GQA cases on this rank; returns the number checked."""
    torch.set_num_threads(1)
    names = ("cp",) if len(mesh_shape) == 1 else ("cp_outer", "cp_ulysses")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    checked = 0
    for causal, balanced, kv_heads in itertools.product((True, False), (True, False), (12, 4)):
        q, k, v, dout = _global_inputs(kv_heads, dtype)
        scale = 0.3 if kv_heads == 4 else None  # the GQA cases also set a softmax scale
        ref = _reference(q, k, v, dout, causal, scale)
        single = _reference(q, k, v, dout, causal, scale, dtype)
        local = [
            shard_sequence(t, mesh, 2, load_balance=balanced).requires_grad_() for t in (q, k, v)
        ]
        attn = ContextParallelAttention(mesh, mode=mode, load_balance=balanced)
        out = attn(*local, is_causal=causal, scale=scale)
        out.backward(shard_sequence(dout, mesh, 2, load_balance=balanced))
        got = [out.detach(), *(t.grad for t in local)]
        for name, g, r, one in zip(("out", "dq", "dk", "dv"), got, ref, single, strict=True):
            expected = shard_sequence(r, mesh, 2, load_balance=balanced)
            assert g is not None
            msg = f"{name} mode={mode} causal={causal} balanced={balanced} kv_heads={kv_heads}"
            if dtype == torch.float32:
                torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5, msg=msg)
            else:
                one_err = (one.float() - r).abs().max().item()  # over the whole sequence
                err = (g.float() - expected).abs().max().item()
                assert err <= 2 * one_err + 5e-3, (msg, err, one_err)
        checked += 1
    return checked


_MODES_1D = ["ring", "allgather", "ulysses"]


@pytest.mark.parametrize("mode", _MODES_1D)
@distributed(world_size=2)
def test_cp2_matches_single_device_fp32(mode: str) -> None:
    assert _check_mode(mode, (2,), torch.float32) == 8


@pytest.mark.parametrize("mode", _MODES_1D)
@distributed(world_size=3)
def test_cp3_matches_single_device_fp32(mode: str) -> None:
    assert _check_mode(mode, (3,), torch.float32) == 8


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@distributed(world_size=3)
def test_cp3_bf16_within_documented_tolerance(mode: str) -> None:
    assert _check_mode(mode, (3,), torch.bfloat16) == 8


@pytest.mark.parametrize("mode", _MODES_1D)
@distributed(world_size=4)
def test_cp4_matches_single_device_fp32(mode: str) -> None:
    assert _check_mode(mode, (4,), torch.float32) == 8


@pytest.mark.parametrize("mode", ["hybrid", "allgather"])
@distributed(world_size=4)
def test_hybrid_2x2_matches_single_device_fp32(mode: str) -> None:
    """Ulysses over mesh dim 1 times ring ("hybrid") or all-gather-KV over dim 0."""
    assert _check_mode(mode, (2, 2), torch.float32) == 8
