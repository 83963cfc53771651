"""Context parallel under activation checkpointing: the recomputation is context-parallel too.

A non-reentrant checkpoint recomputes the forward inside the backward pass, where the autograd
engine runs with no ``TorchFunctionMode`` active (and on accelerators on its own thread): a
routing of SDPA that lives in a mode would recompute single-device attention on the shards.
Checked here, for every mode at cp 3 (odd, non-power-of-two):

* full and selective (per-op policy keeping the attention kernel's outputs) checkpointing give
  the loss and every gradient of the same run without checkpointing, bitwise, and of one process
  within 1e-5; the engine really runs twice per block (forward and recomputation);
* the module style front recomputes context-parallel too;
* the route is process-wide: a backward run on another thread recomputes context-parallel; the
  route is removed on exit (after an error too) and the innermost of nested contexts answers;
* in a compiled block (``aot_eager``) the attention is a graph break: the engine runs eagerly
  between compiled pieces, with the gradients of eager CP (1e-5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hp_cp_ep.cp import ContextParallel, ContextParallelAttention, context_parallel, shard_sequence
from hp_dtensor.testing import distributed

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH = 32, 24, 6, 3, 12, 2
HEAD_DIM = DIM // HEADS
_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Attention(nn.Module):
    """q, k, v ``[B, H, S, D]`` -> causal GQA SDPA (the call context parallel redirects)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wkv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.attn = Attention()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x) + pos[None, :, None] / SEQ  # positions enter: shards must be right
        q = self.wq(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        x = x + self.wo(self.attn(q, k, v).transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(x)))


def _keep_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if func is _KERNEL:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_attention)


_VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "full": {},
    "selective": {"context_fn": _selective_contexts},
}


class Decoder(nn.Module):
    def __init__(self, variant: str = "none") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpoint_kwargs = _VARIANTS[variant]

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint_kwargs is None:
                x = block(x, pos)
            else:
                x = checkpoint(block, x, pos, use_reentrant=False, **self.checkpoint_kwargs)
        return self.head(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.clone()
    return out


def _one_process() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Decoder()
    tokens, labels = _data()
    loss = F.cross_entropy(model(tokens, torch.arange(SEQ)).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), _grads(model)


@contextmanager
def _count_engine_calls() -> Iterator[list[str]]:
    """The engine calls (their modes): every SDPA call routed context-parallel, recomputes too."""
    calls: list[str] = []
    original = ContextParallelAttention.__call__

    def counted(self: ContextParallelAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.mode)
        return original(self, *args, **kwargs)

    ContextParallelAttention.__call__ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        ContextParallelAttention.__call__ = original  # type: ignore[method-assign]


def _cp_step(
    mesh: Any, mode: str, variant: str, backward: Callable[[torch.Tensor], None] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward/backward on this rank's shard; loss and grads summed over the CP ranks."""
    torch.manual_seed(0)
    model = Decoder(variant)
    tokens, labels = _data()
    pos = torch.arange(SEQ)
    with (
        _count_engine_calls() as calls,
        context_parallel(mesh, buffers=[tokens, labels, pos], buffer_seq_dims=[1, 1, 0], mode=mode),
    ):
        logits = model(tokens, pos)
        # this rank's token sum over the global token count: the sum over ranks is the mean
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss = loss / (BATCH * SEQ)
        (backward or torch.Tensor.backward)(loss)
    grads = _grads(model)
    for g in [loss, *grads.values()]:
        dist.all_reduce(g)
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
@distributed(world_size=3)
def test_checkpointed_blocks_recompute_context_parallel(mode: str) -> None:
    mesh = init_device_mesh("cpu", (3,))
    want_loss, want_grads = _one_process()
    base_loss, base_grads, base_calls = _cp_step(mesh, mode, "none")
    assert base_calls == 2  # one attention per block
    torch.testing.assert_close(base_loss, want_loss, rtol=1e-5, atol=1e-5)
    for name, g in base_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    for variant in ("full", "selective"):
        loss, grads, calls = _cp_step(mesh, mode, variant)
        assert calls == 4, variant  # forward + recomputation of each block's attention
        assert torch.equal(loss, base_loss), variant
        for name, g in grads.items():
            assert torch.equal(g, base_grads[name]), f"{variant}: {name}"


@distributed(world_size=2)
def test_recomputation_on_another_thread_and_style_front() -> None:
    mesh = init_device_mesh("cpu", (2,))
    base_loss, base_grads, _ = _cp_step(mesh, "ring", "none")

    def backward_on_a_thread(loss: torch.Tensor) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                loss.backward()
            except BaseException as e:  # re-raised on the calling thread
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    loss, grads, calls = _cp_step(mesh, "ring", "full", backward_on_a_thread)
    assert calls == 4
    assert torch.equal(loss, base_loss)
    for name, g in grads.items():
        assert torch.equal(g, base_grads[name]), name

    # the module style: its forward hooks redirect SDPA again in the recomputation
    torch.manual_seed(0)
    model = Decoder("full")
    for block in model.blocks:
        ContextParallel(seq_dim=2, head_dim=1, ulysses_degree=1, load_balance=True)._apply(
            block.attn, mesh
        )
    tokens, labels = (shard_sequence(t, mesh, 1, load_balance=True) for t in _data())
    pos = shard_sequence(torch.arange(SEQ), mesh, 0, load_balance=True)
    loss = F.cross_entropy(model(tokens, pos).flatten(0, 1), labels.flatten(), reduction="sum")
    loss = loss / (BATCH * SEQ)
    loss.backward()
    style_grads = _grads(model)
    for g in [loss, *style_grads.values()]:
        dist.all_reduce(g)
    torch.testing.assert_close(loss.detach(), base_loss, rtol=1e-6, atol=1e-6)
    for name, g in style_grads.items():
        torch.testing.assert_close(g, base_grads[name], rtol=1e-6, atol=1e-6, msg=name)


@distributed(world_size=2)
def test_route_is_removed_on_exit_and_innermost_context_answers() -> None:
    single_device = torch._C._nn.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is single_device
    whole = init_device_mesh("cpu", (2,))

    def fail_inside() -> None:
        with context_parallel(whole, mode="ring"):
            assert F.scaled_dot_product_attention is not single_device
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert F.scaled_dot_product_attention is single_device

    # nested: the inner context's engine answers, the outer one's again after it exits
    q = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    with _count_engine_calls() as calls, context_parallel(whole, mode="ring"):
        outer = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with context_parallel(whole, mode="allgather"):
            inner = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        after = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls == ["ring", "allgather", "ring"]
    torch.testing.assert_close(inner, outer, rtol=1e-6, atol=1e-6)
    assert torch.equal(after, outer)
    assert F.scaled_dot_product_attention is single_device


@distributed(world_size=2)
def test_compiled_blocks_call_the_engine_eagerly() -> None:
    mesh = init_device_mesh("cpu", (2,))
    base_loss, base_grads, _ = _cp_step(mesh, "ring", "none")
    torch.manual_seed(0)
    model = Decoder()
    block = model.blocks[0]  # one compiled block keeps the test short
    block.forward = torch.compile(block.forward, backend="aot_eager")  # type: ignore[method-assign]
    torch._dynamo.reset()  # type: ignore[no-untyped-call]
    counters = torch._dynamo.utils.counters
    counters.clear()
    tokens, labels = _data()
    pos = torch.arange(SEQ)
    with (
        _count_engine_calls() as calls,
        context_parallel(
            mesh, buffers=[tokens, labels, pos], buffer_seq_dims=[1, 1, 0], mode="ring"
        ),
    ):
        loss = F.cross_entropy(model(tokens, pos).flatten(0, 1), labels.flatten(), reduction="sum")
        loss = loss / (BATCH * SEQ)
        loss.backward()
    assert len(calls) == 2  # the attention ran eagerly through the engine, once per block
    assert counters["stats"]["unique_graphs"] >= 2  # the pieces around it were compiled
    grads = _grads(model)
    for g in [loss, *grads.values()]:
        dist.all_reduce(g)
    torch.testing.assert_close(loss.detach(), base_loss, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, base_grads[name], rtol=1e-5, atol=1e-5, msg=name)
