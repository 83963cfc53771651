"""checkpoint(swap_inputs=True) and MUST_SWAP inside checkpoint: parity, counts, freed storages."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_trainer import CheckpointPolicy, SwapManager, checkpoint, checkpoint_wrapper

DIM = 32
ADDMM = torch.ops.aten.addmm.default


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh saves its output, so the recompute must run down's addmm too (no early stop)
        return x + torch.tanh(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _blocks(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(_Block() for _ in range(n))


def _data() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 8, DIM)


def _run(
    blocks: nn.ModuleList, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = _data().requires_grad_()
    h = x * 1.5
    for block in blocks:
        h = call(block, h)
    loss = h.square().mean()
    loss.backward()
    assert x.grad is not None
    return loss.detach(), [x.grad, *(p.grad.clone() for p in blocks.parameters())]  # type: ignore[union-attr]


def _assert_bitwise(got: tuple[Any, list[torch.Tensor]], want: tuple[Any, list[torch.Tensor]]):
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)


def _up_must(policy: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    """Policy: ``policy`` for the up projection's addmm, recompute everything else."""

    def fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func is ADDMM and args[2].shape[1] == 2 * DIM:
            return policy
        return CheckpointPolicy.PREFER_RECOMPUTE

    return fn


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_swap_inputs_is_bitwise_equal_and_counts_hooks() -> None:
    plain = _run(_blocks(), lambda b, h: b(h))
    torch_ckpt_result = _run(
        _blocks(), lambda b, h: torch_ckpt.checkpoint(b, h, use_reentrant=False)
    )
    _assert_bitwise(torch_ckpt_result, plain)

    manager = SwapManager()
    swapped = _run(_blocks(), lambda b, h: checkpoint(b, h, swap_inputs=True, manager=manager))
    _assert_bitwise(swapped, plain)
    _assert_bitwise(swapped, torch_ckpt_result)

    assert [(g.packs, g.unpacks, g.state) for g in manager.groups] == [(1, 1, "device")] * 3
    log = manager.log
    assert [e for e in log if e[0] == "pack"] == [("pack", 0), ("pack", 1), ("pack", 2)]
    # backward runs the blocks in reverse; each one's recompute starts by prefetching the next
    backward = [e for e in log if e[0] in ("backward", "load")]
    assert backward == [
        ("backward", 2),
        ("load", 2),
        ("load", 1),
        ("backward", 1),
        ("load", 0),
        ("backward", 0),
    ]
    # a second step reuses the pooled host buffers
    allocated = manager.pool.allocations
    _assert_bitwise(
        _run(_blocks(), lambda b, h: checkpoint(b, h, swap_inputs=True, manager=manager)), plain
    )
    assert manager.pool.allocations == allocated
    assert len(manager.groups) == 3


def test_swapped_input_storage_is_released() -> None:
    block = _blocks(1)[0]
    pre = nn.Linear(DIM, DIM)
    x = _data()

    # control: PyTorch's checkpoint keeps its input alive until backward
    h = pre(x)
    ref = weakref.ref(h)
    out = torch_ckpt.checkpoint(block, h, use_reentrant=False)
    del h
    assert ref() is not None
    del out
    assert ref() is None

    manager = SwapManager()
    h = pre(x)
    ref = weakref.ref(h)
    storage = h.untyped_storage()
    out = checkpoint(block, h, swap_inputs=True, manager=manager)
    del h
    manager.wait_all_offloads()
    assert ref() is None
    # only this test's own reference to the input's device storage is left
    assert torch._C._storage_Use_Count(storage._cdata) == 1
    assert manager.groups[0].state == "host"
    out.sum().backward()
    assert manager.groups[0].state == "device"


def test_must_swap_output_is_not_recomputed() -> None:
    plain = _run(_blocks(), lambda b, h: b(h))
    saved = _run(
        _blocks(),
        lambda b, h: checkpoint(b, h, policy_fn=_up_must(CheckpointPolicy.MUST_SAVE)),
    )
    _assert_bitwise(saved, plain)

    manager = SwapManager()
    blocks = _blocks(1)
    wrapped = checkpoint_wrapper(
        blocks[0], policy_fn=_up_must(CheckpointPolicy.MUST_SWAP), manager=manager
    )
    out = wrapped(_data())
    counter = _CountOps()
    with counter:
        out.square().mean().backward()
    # the down projection is recomputed, the swapped up projection is loaded back instead
    assert counter.calls.get(ADDMM) == 1
    assert [(g.packs, g.unpacks) for g in manager.groups] == [(1, 1)]

    plain_ckpt = _blocks(1)
    out = torch_ckpt.checkpoint(plain_ckpt[0], _data(), use_reentrant=False)
    counter = _CountOps()
    with counter:
        out.square().mean().backward()
    assert counter.calls.get(ADDMM) == 2  # control: both recomputed

    def swapped_call(b: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(
            b, h, policy_fn=_up_must(CheckpointPolicy.MUST_SWAP), manager=manager, swap_inputs=True
        )

    manager = SwapManager()
    swapped = _run(_blocks(), swapped_call)
    _assert_bitwise(swapped, plain)
    _assert_bitwise(swapped, saved)
    # per block: the input and the up projection's output, each packed and unpacked once
    assert [(g.packs, g.unpacks) for g in manager.groups] == [(2, 2)] * 3


def test_must_swap_output_storage_is_released() -> None:
    storages: list[torch.UntypedStorage] = []

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        value = _up_must(CheckpointPolicy.MUST_SWAP)(ctx, func, *args, **kwargs)
        if value is CheckpointPolicy.MUST_SWAP:
            storages.append(ctx.op_output.untyped_storage())
        return value

    manager = SwapManager()
    block = _blocks(1)[0]
    out = checkpoint(block, _data(), policy_fn=policy, manager=manager)
    manager.wait_all_offloads()
    assert len(storages) == 1
    assert torch._C._storage_Use_Count(storages[0]._cdata) == 1
    out.sum().backward()


def test_swap_needs_non_reentrant() -> None:
    block = _blocks(1)[0]
    with pytest.raises(ValueError, match="use_reentrant"):
        checkpoint(block, _data(), swap_inputs=True, use_reentrant=True)
