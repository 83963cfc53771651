"""The three fronts over the CP engine, in training: a small decoder trained with context parallel.

* PyTorch's ``context_parallel`` (buffers sharded in place, SDPA redirected) with hp-fsdp's
  ``fully_shard`` over the flattened ``dp x cp`` axis: 3 training steps on 4 ranks (dp 2 x cp 2)
  equal one process training on the whole batch (loss and parameters within 1e-5).
* HyperParallel's ``ContextParallel`` / ``AsyncContextParallel`` styles on the core attention
  module at cp = 3: one step's loss and
  gradients equal one process's.
* Composition with TP: heads sharded by ``hp_tp`` (colwise q/k/v, rowwise out) over ``tp``, the
  sequence by CP ring over ``cp`` on a 2 x 2 mesh; gradients equal one process's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_fsdp
from hp_cp_ep.cp import (
    AsyncContextParallel,
    ContextParallel,
    context_parallel,
    context_parallel_unshard,
    get_rotate_method,
    set_rotate_method,
    shard_sequence,
)
from hp_dtensor.testing import distributed

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH = 40, 24, 6, 3, 12, 4
HEAD_DIM = DIM // HEADS


class CoreAttention(nn.Module):
    """q, k, v in ``[B, S, H, D]`` (HyperParallel's seq_dim=1, head_dim=2) -> ``[B, S, H, D]``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.float()[:, None] * freqs[None, :]  # [S, half]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wkv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.inner = CoreAttention()
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU())
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, s, HEADS, HEAD_DIM)
        k, v = self.wkv(h).view(b, s, 2, KV_HEADS, HEAD_DIM).unbind(2)
        o = self.inner(_rope(q, positions), _rope(k, positions), v)
        x = x + self.wo(o.reshape(b, s, DIM))
        return x + self.down(self.mlp(x))


class Decoder(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor) -> Any:
    logits = model(tokens, pos)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _single_process_losses(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, labels = _batch(step)
        loss = _loss(model, tokens, labels, torch.arange(SEQ))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@distributed(world_size=4, timeout=120)
def test_decoder_cp2_dp2_with_fully_shard_trains_like_one_process() -> None:
    torch.manual_seed(0)
    base = Decoder()
    reference = copy.deepcopy(base)
    expected = _single_process_losses(reference, 3)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_mesh = mesh.get_local_rank("dp"), mesh["cp"]
    model = copy.deepcopy(base)
    for block in model.blocks:
        hp_fsdp.fully_shard(block, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    hp_fsdp.fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    set_rotate_method("alltoall")  # PyTorch's name for K/V rotation: our ring
    try:
        assert get_rotate_method() == "ring"
        for step in range(3):
            tokens, labels = (t[rows].clone() for t in _batch(step))
            positions = torch.arange(SEQ)
            with context_parallel(
                cp_mesh,
                buffers=[tokens, labels, positions],
                buffer_seq_dims=[1, 1, 0],
                no_restore_buffers={tokens, labels},
            ):
                assert tokens.shape == (BATCH // 2, SEQ // 2)  # sharded in place
                local_loss = _loss(model, tokens, labels, positions)
                local_loss.backward()  # FSDP averages over dp x cp: the global token mean
            assert positions.shape == (SEQ,)  # restored
            assert torch.equal(positions, torch.arange(SEQ))
            opt.step()
            opt.zero_grad()
            loss = local_loss.detach().clone()
            dist.all_reduce(loss)
            torch.testing.assert_close(loss.item() / 4, expected[step], rtol=1e-5, atol=1e-5)
    finally:
        set_rotate_method("allgather")
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full, r, rtol=1e-5, atol=1e-5, msg=name)


@contextmanager
def _styled(model: Decoder, style: Any, mesh: Any) -> Iterator[Decoder]:
    for block in model.blocks:
        style._apply(block.inner, mesh)
    yield model


def _one_step_grads(model: nn.Module, ctx: Any, mesh: Any, balanced: bool) -> dict[str, Any]:
    tokens, labels = _batch(7)
    positions = torch.arange(SEQ)
    with ctx:
        local = [shard_sequence(t, mesh, 1, load_balance=balanced) for t in (tokens, labels)]
        pos = shard_sequence(positions, mesh, 0, load_balance=balanced)
        loss = _loss(model, local[0], local[1], pos)
        logits = model(local[0], pos)
        (full_logits,) = context_parallel_unshard(mesh, [logits], [1], load_balance=balanced)
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None
        grads[name] = p.grad.clone()
        dist.all_reduce(grads[name])
        grads[name] /= mesh.size()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": total / mesh.size(), "grads": grads, "logits": full_logits}


def _reference_step() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Decoder(blocks=1)
    tokens, labels = _batch(7)
    loss = _loss(model, tokens, labels, torch.arange(SEQ))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "logits": model(tokens, torch.arange(SEQ))}


def _assert_step_matches(got: dict[str, Any], want: dict[str, Any]) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["logits"], want["logits"].detach(), rtol=1e-5, atol=1e-5)
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, want["grads"][name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("style_cls", "kwargs"),
    [
        (ContextParallel, {"ulysses_degree": None, "load_balance": True}),
        (AsyncContextParallel, {"ulysses_degree": None}),
        (ContextParallel, {"ulysses_degree": 1, "load_balance": True}),
        (AsyncContextParallel, {"ulysses_degree": 1, "kv_exchange": "ring"}),
    ],
)
@distributed(world_size=3)
def test_hyperparallel_style_step_matches_one_process(style_cls: Any, kwargs: Any) -> None:
    want = _reference_step()
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    model = Decoder(blocks=1)
    style = style_cls(seq_dim=1, head_dim=2, **kwargs)
    for block in model.blocks:
        style._apply(block.inner, mesh)
    got = _one_step_grads(model, torch.enable_grad(), mesh, kwargs.get("load_balance", False))
    _assert_step_matches(got, want)
    # Outside the module, SDPA is untouched (the redirect lives only in its forward).
    q = torch.randn(1, 2, 4, 4)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, q, q), F.softmax(q @ q.mT / 2, -1) @ q
    )


@distributed(world_size=2)
def test_fronts_reject_bad_input_and_cp1_is_a_no_op() -> None:
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(1, 2, 4, 4)
    with context_parallel(mesh), pytest.raises(ValueError, match="supports is_causal=True or no"):
        F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with context_parallel(mesh), pytest.raises(ValueError, match=r"dropout_p=0\.0 only"):
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)
    with context_parallel(mesh), pytest.raises(ValueError, match="pass enable_gqa=True"):
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1])
    with (
        pytest.raises(ValueError, match="same length"),
        context_parallel(mesh, buffers=[x], buffer_seq_dims=[]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="subset of buffers"),
        context_parallel(mesh, buffers=[x], buffer_seq_dims=[2], no_restore_buffers={x[0]}),
    ):
        pass
    with pytest.raises(ValueError, match="rotate_method must be one of"):
        set_rotate_method("butterfly")
    with pytest.raises(ValueError, match="ulysses_degree 3 on a 1-D mesh of 2"):
        ContextParallel(ulysses_degree=3)._apply(CoreAttention(), mesh)
    with pytest.raises(ValueError, match="kv_exchange must be one of"):
        ContextParallel(kv_exchange="p2p")
    attn = ContextParallel(seq_dim=1, head_dim=2)._apply(CoreAttention(), mesh)
    y = torch.randn(1, 4, 3, 4)  # 3 heads at dim 2: not divisible by the Ulysses degree 2
    with pytest.raises(ValueError, match=r"3 heads \(dim 2\) are not divisible by the Ulysses"):
        attn(y, y, y)
    # CP degree 1: no hooks, no sharding, no redirection: plain SDPA on the same tensors.
    single = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))["cp"]
    module = CoreAttention()
    ContextParallel(ulysses_degree=1)._apply(module, single)
    assert not module._forward_pre_hooks
    assert not module._forward_hooks
    buf = torch.arange(6)
    with context_parallel(single, buffers=[buf], buffer_seq_dims=[0]):
        assert buf.shape == (6,)
        assert not torch.overrides._is_torch_function_mode_enabled()
    assert math.isclose(float(buf.sum()), 15.0)


class _TPAttention(nn.Module):
    """Self-attention whose head count follows the (TP-sharded) projections: ``view(-1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, 2 * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, 2 * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = _rope(self.wq(x).view(b, s, -1, HEAD_DIM), positions).transpose(1, 2)
        k = _rope(self.wk(x).view(b, s, -1, HEAD_DIM), positions).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attention = _TPAttention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.attention(x, positions))


@distributed(world_size=4)
def test_cp2_composes_with_tp2_heads_sharded() -> None:
    import hp_tp

    torch.manual_seed(0)
    base = _TPModel()
    reference = copy.deepcopy(base)
    tokens, labels = _batch(3)
    _loss(reference, tokens, labels, torch.arange(SEQ)).backward()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = copy.deepcopy(base)
    plan = {
        "attention.wq": hp_tp.ColwiseParallel(),
        "attention.wk": hp_tp.ColwiseParallel(),
        "attention.wv": hp_tp.ColwiseParallel(),
        "attention.wo": hp_tp.RowwiseParallel(),
    }
    hp_tp.parallelize_module(model, mesh["tp"], plan)
    positions = torch.arange(SEQ)
    with context_parallel(
        mesh["cp"], buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0], mode="ring"
    ):
        loss = _loss(model, tokens, labels, positions)  # 3 of 6 query heads, 1 of 2 K/V heads
        loss.backward()
    cp_group = mesh["cp"].get_group()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()
        dist.all_reduce(local, group=cp_group)  # every CP rank's tokens contribute
        local /= 2
        if isinstance(grad, DTensor):
            full = DTensor.from_local(local, grad.device_mesh, grad.placements).full_tensor()
        else:
            full = local
        assert r.grad is not None
        torch.testing.assert_close(full, r.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
@distributed(world_size=4)
def test_hyperparallel_style_on_2d_mesh_is_the_hybrid(kv_exchange: str) -> None:
    want = _reference_step()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_outer", "cp_ulysses"))
    torch.manual_seed(0)
    model = Decoder(blocks=1)
    # SEQ = 12 is not a multiple of 2 x 4: contiguous shards here (balancing is tested at cp 3).
    style = ContextParallel(ulysses_degree=2, kv_exchange=kv_exchange)
    for block in model.blocks:
        style._apply(block.inner, mesh)
    _assert_step_matches(_one_step_grads(model, torch.enable_grad(), mesh, False), want)


def _fail_inside(mesh: Any, tokens: torch.Tensor, seen: list[tuple[int, ...]]) -> None:
    with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
        seen.append(tuple(tokens.shape))
        raise RuntimeError("boom")


@distributed(world_size=2)
def test_context_parallel_restores_buffers_after_an_error() -> None:
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.arange(8).view(1, 8)
    seen: list[tuple[int, ...]] = []
    with pytest.raises(RuntimeError, match="boom"):
        _fail_inside(mesh, tokens, seen)
    assert seen == [(1, 4)]
    assert torch.equal(tokens, torch.arange(8).view(1, 8))
    assert not torch.overrides._is_torch_function_mode_enabled()
