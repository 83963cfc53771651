"""Activation swap: bitwise parity, hook counts, prefetch order, freed storages, pool reuse."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hp_trainer import (
    CheckpointPolicy,
    SwapManager,
    checkpoint_wrapper,
    swap,
    swap_wrapper,
)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.intermediates: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        a = torch.nn.functional.gelu(h)
        self.intermediates = [weakref.ref(h), weakref.ref(a)]
        return x + self.down(a)


def _model(n: int = 3, dim: int = 48) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(dim) for _ in range(n)])


def _data() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 16, 48)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_swap_is_bitwise_equal_and_prefetches_next_layer() -> None:
    ref = _model()
    x = _data()
    ref_loss = ref(x).square().mean()
    ref_loss.backward()

    model = _model()
    manager = SwapManager()
    for i in range(len(model)):
        model[i] = swap_wrapper(model[i], manager=manager)
    for step in range(2):
        model.zero_grad()
        loss = model(x).square().mean()
        assert torch.equal(loss, ref_loss)
        # every block's forward is swapped: packs happen, nothing is unpacked before backward
        groups = list(manager.groups)
        assert len(groups) == 3
        assert all(g.packs > 0 for g in groups)
        manager.log.clear()
        loss.backward()
        for got, want in zip(_grads(model), _grads(ref), strict=True):
            assert torch.equal(got, want)
        assert all(g.unpacks == g.packs for g in groups)
        log = manager.log
        # backward runs blocks 2, 1, 0; block i-1's load is launched at block i's first unpack,
        # before block i's last unpack (i.e. before its backward finishes)
        for i in (2, 1):
            last_unpack_i = max(k for k, e in enumerate(log) if e == ("unpack", i))
            assert log.index(("load", i - 1)) < last_unpack_i
            assert log.index(("load", i - 1)) < log.index(("backward", i - 1))
        assert [e for e in log if e[0] == "backward"] == [
            ("backward", 2),
            ("backward", 1),
            ("backward", 0),
        ]
        if step == 0:
            allocated = manager.pool.allocations
    # the second step reused the host buffers of the first
    assert manager.pool.allocations == allocated


def test_swapped_storages_are_freed() -> None:
    x = _data()
    plain = _model(1)
    loss = plain(x).sum()
    assert all(r() is not None for r in plain[0].intermediates)  # autograd keeps them
    del loss

    model = _model(1)
    manager = SwapManager()
    out = swap(model[0], x, manager=manager)
    manager.wait_all_offloads()
    # the device tensors are gone: only the (pooled) host copies hold the values
    assert all(r() is None for r in model[0].intermediates)
    assert manager.groups[0].state == "host"
    out.sum().backward()


def test_policy_swaps_only_marked_ops() -> None:
    x = _data()

    def policy(ctx: object, func: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if func is torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SWAP
        return CheckpointPolicy.MUST_SAVE

    ref = _model(1)
    ref(x).square().mean().backward()
    model = _model(1)
    manager = SwapManager()
    loss = swap(model[0], x, policy_fn=policy, manager=manager)
    loss.square().mean().backward()
    for got, want in zip(_grads(model), _grads(ref), strict=True):
        assert torch.equal(got, want)
    everything = SwapManager()
    swap(_model(1)[0], x, manager=everything)
    assert 0 < manager.groups[0].packs < everything.groups[0].packs


def test_checkpoint_api() -> None:
    x = _data()
    ref = _model(2)
    ref(x).sum().backward()

    def policy(ctx: object, func: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return (
            CheckpointPolicy.MUST_SAVE
            if func is torch.ops.aten.addmm.default
            else (CheckpointPolicy.PREFER_RECOMPUTE)
        )

    model = _model(2)
    model[0] = checkpoint_wrapper(model[0], policy_fn=policy)
    model[1] = checkpoint_wrapper(model[1])
    model(x).sum().backward()
    for got, want in zip(_grads(model), _grads(ref), strict=True):
        assert torch.equal(got, want)
    assert set(model.state_dict()) == set(ref.state_dict())

    assert CheckpointPolicy.MUST_SWAP == 4
    assert CheckpointPolicy.PREFER_RECOMPUTE.to_torch() is (
        torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    )


def test_no_host_wait_per_layer_events_order_copies() -> None:
    """The recording double: every ordering is an event on the copy stream waited on by the
    compute stream (or a stream wait); the host never synchronizes, in forward or backward;
    results stay bitwise equal over two steps (the second reuses the pooled buffers)."""
    from hp_dtensor.device import StreamLog

    ref = _model()
    x = _data()
    ref(x).square().mean().backward()
    log = StreamLog()
    model = _model()
    manager = SwapManager(stream_log=log)
    for i in range(len(model)):
        model[i] = swap_wrapper(model[i], manager=manager)
    for step in range(2):
        log.entries.clear()
        model.zero_grad()
        loss = model(x).square().mean()
        forward = list(log.entries)
        loss.backward()
        for got, want in zip(_grads(model), _grads(ref), strict=True):
            assert torch.equal(got, want)
        entries = log.entries
        assert log.count("synchronize") == 0, [e for e in entries if e[0] == "synchronize"]
        at = entries.index
        for i in range(3):
            # offload: after the layer's forward (stream wait), recorded on the copy stream,
            # waited on by the compute stream before the device storages are dropped
            assert ("record", f"offload{i}", "copy") in entries
            assert at(("record", f"offload{i}", "copy")) < at(
                ("wait_event", "compute", f"offload{i}")
            )
            # load: recorded on the copy stream, waited on by the compute stream
            assert at(("record", f"load{i}", "copy")) < at(("wait_event", "compute", f"load{i}"))
        for i in range(2):  # in forward, layer i's copies are waited for at layer i+1's end
            assert ("wait_event", "compute", f"offload{i}") in forward
            assert at(("wait_event", "compute", f"offload{i}")) < at(
                ("record", f"offload{i + 1}", "copy")
            )
        # backward order 2, 1, 0: layer i's load is launched as layer i+1's backward starts
        # (after the compute stream's wait for layer i+1's load), so it overlaps that backward
        for i in (1, 0):
            assert (
                at(("wait_event", "compute", f"load{i + 1}"))
                < at(("record", f"load{i}", "copy"))
                < at(("wait_event", "compute", f"load{i}"))
            )
        if step == 1:  # reused host buffers: the copy stream waits for their last load
            waits = [e for e in forward if e[:2] == ("wait_event", "copy")]
            assert waits, forward
            assert all(e[2].startswith("load") for e in waits)
