"""CPU offload without host syncs on the hot path, observed through the device layer's double.

On the CPU the gradients are in host memory already, so the offload copy is skipped. The
recording stream double (``CommStreams.recording``) treats every tensor as device memory: the
device-to-host gradient copies, the events recorded after them and every host wait then run
and are logged exactly as on an accelerator. The device layer's own copy is checked separately
(non-blocking, into pinned memory where the device has it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import hp_dtensor.device as device_layer
import hp_fsdp
from hp_dtensor.device import StreamLog
from hp_dtensor.testing import distributed
from hp_fsdp.state import get_state
from hp_fsdp.streams import CommStreams

aten = torch.ops.aten
DIM = 8


class _Stack(nn.Module):
    """Two blocks of ``width`` linears and a head: three units, 4 * width + 2 parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(width))) for _ in range(2)
        )
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _offloaded(model: nn.Module, api: Any, policy: Any, mesh: Any) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        api.fully_shard(block, mesh=mesh, offload_policy=policy)
    api.fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def _backward(model: nn.Module, gen: torch.Generator) -> None:
    model(torch.randn(3, DIM, generator=gen)).square().sum().backward()


def _assert_grads_equal(ours: nn.Module, theirs: nn.Module) -> None:
    for (name, p_ours), (_, p_theirs) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert p_ours.grad.device.type == "cpu", name
        assert torch.equal(p_ours.grad.to_local(), p_theirs.grad.to_local()), name


def _host_syncs(width: int) -> tuple[int, list[tuple[str, ...]], list[tuple[str, ...]]]:
    """One offloaded model (``width`` linears per block) stepped with recording streams.

    Returns the parameter count, the log of a plain backward and that of an accumulating one.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = _Stack(width)
    ours = _offloaded(
        copy.deepcopy(base), hp_fsdp, hp_fsdp.CPUOffloadPolicy(pin_memory=False), mesh
    )
    theirs = _offloaded(
        copy.deepcopy(base), torch_fsdp, torch_fsdp.CPUOffloadPolicy(pin_memory=False), mesh
    )
    gens = [torch.Generator().manual_seed(10 + dist.get_rank()) for _ in range(2)]
    for model, gen in zip((ours, theirs), gens, strict=True):  # lazy init, plain streams
        _backward(model, gen)
        model.zero_grad()
    state = get_state(ours)
    assert state is not None
    assert state.ctx is not None
    log = StreamLog()
    state.ctx.comm.streams = CommStreams.recording(log)
    logs = []
    for _ in range(2):  # a fresh gradient, then one accumulated into it
        log.entries.clear()
        for model, gen in zip((ours, theirs), gens, strict=True):
            _backward(model, gen)
        _assert_grads_equal(ours, theirs)
        logs.append(list(log.entries))
    return sum(1 for _ in ours.parameters()), logs[0], logs[1]


def _check_host_syncs() -> None:
    host_waits = []
    for width in (1, 3):
        n_params, fresh, accumulated = _host_syncs(width)
        copies = [e for e in fresh if e[0] == "copy_to_host"]
        syncs = [e for e in fresh if e[0] == "synchronize"]
        # every gradient goes to the host through the device layer's asynchronous copy, on
        # the post-reduce (reduce-scatter) stream; no stream or device synchronize
        assert len(copies) == n_params, (width, copies)
        assert set(copies) == {("copy_to_host", "reduce_scatter")}
        assert syncs == [("synchronize", "post_reduce")], syncs
        # the host waits once, at the end of backward, after every copy and event record
        last_copy = max(i for i, e in enumerate(fresh) if e[0] == "copy_to_host")
        last_record = max(i for i, e in enumerate(fresh) if e[:2] == ("record", "post_reduce"))
        assert fresh.index(syncs[0]) > max(last_copy, last_record)
        # accumulating into host gradients reads the copies at once: one wait per unit
        acc_syncs = [e for e in accumulated if e[0] == "synchronize"]
        assert acc_syncs == [("synchronize", "host_copy")] * 3, acc_syncs
        host_waits.append((len(syncs), len(acc_syncs)))
    assert host_waits[0] == host_waits[1] == (1, 3)  # 6 and 14 parameters: the same waits


@distributed(world_size=2, timeout=120)
def test_offloaded_gradients_one_host_wait_per_backward_ws2() -> None:
    _check_host_syncs()


@distributed(world_size=3, timeout=120)
def test_offloaded_gradients_one_host_wait_per_backward_ws3() -> None:
    _check_host_syncs()


class _CopySpy(TorchDispatchMode):
    """Records host allocations (their ``pin_memory``) and copies (their ``non_blocking``).

    Pinning needs an accelerator, so the allocation runs unpinned; copies from the meta
    "device" are recorded and skipped.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is aten.empty_like.default:
            self.calls.append(("empty_like", kwargs.get("pin_memory")))
            kwargs["pin_memory"] = False
        elif func is aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.calls.append(("copy_", non_blocking))
            return args[0]
        return func(*args, **kwargs)


def test_device_copy_to_host_is_non_blocking_into_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_layer, "pin_memory_available", lambda: True)
    on_device = torch.empty(3, 4, device="meta")  # stands in for accelerator memory
    spy = _CopySpy()
    with spy:
        host = device_layer.Stream("cpu").copy_to_host(on_device)
    assert spy.calls == [("empty_like", True), ("copy_", True)]
    assert host.device.type == "cpu"
    assert host.shape == (3, 4)
    in_host_memory = torch.ones(2)
    assert device_layer.Stream("cpu").copy_to_host(in_host_memory) is in_host_memory
