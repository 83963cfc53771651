"""check_device_groups: host tensors and object collectives on a device group are caught on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import device as device_layer
from hp_dtensor.testing import (
    HostTensorOnDeviceGroupError,
    check_device_groups,
    distributed,
    rank_seed,
)

CPU = torch.device("cpu")


def test_marks_follow_factories_copies_and_results() -> None:
    before = torch.randn(3)  # made before the block: the model's tensors live on the device
    with check_device_groups(device=CPU) as checker:
        host = torch.tensor([1.0, 2.0, 3.0])
        assert checker.is_host(host)
        assert checker.is_host(host + before)  # computed from a host tensor
        assert not checker.is_host(before * 2)
        moved = host.to(CPU)
        assert moved is not host  # a host-to-device copy, as on an accelerator
        assert not checker.is_host(moved)
        assert before.to(CPU) is before  # a device tensor stays itself
        assert not checker.is_host(torch.zeros(2, device=CPU))
        assert checker.is_host(before.cpu())
        assert checker.is_host(torch.frombuffer(bytearray(8), dtype=torch.uint8))
        assert device_layer.is_accelerator()
        assert not device_layer.pin_memory_available()
        assert not device_layer.is_accelerator("cpu")
    assert not device_layer.is_accelerator()
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


@distributed(world_size=2)
def test_host_tensors_on_a_device_group_are_refused() -> None:
    torch.manual_seed(rank_seed(0))
    on_device = torch.randn(4)
    with check_device_groups(device=CPU) as checker:
        dist.all_reduce(on_device)
        dist.all_reduce(torch.ones(2, device=CPU))
        with pytest.raises(HostTensorOnDeviceGroupError, match="all_reduce on a device group"):
            dist.all_reduce(torch.tensor([dist.get_rank()], dtype=torch.int64))
        # The fix: the same value made on the device.
        flag = torch.tensor([dist.get_rank()], dtype=torch.int64).to(CPU)
        dist.all_reduce(flag)
        assert int(flag.item()) == 1
        # A CPU side group may carry host tensors and objects.
        side = dist.new_group(backend="gloo")
        dist.all_reduce(torch.tensor([1]), group=side)
        objects: list[object] = [None, None]
        dist.all_gather_object(objects, dist.get_rank(), group=side)
        assert objects == [0, 1]
        assert checker.count("all_reduce", "side") == 1
        assert checker.count("all_reduce", "device") == 4
        # Point-to-point in a batch: every P2POp's tensor is checked.
        peer = 1 - dist.get_rank()
        out = torch.empty(3, device=CPU)
        ops = [
            dist.P2POp(dist.distributed_c10d.isend, torch.zeros(3), peer),
            dist.P2POp(dist.distributed_c10d.irecv, out, peer),
        ]
        with pytest.raises(HostTensorOnDeviceGroupError, match="batch_isend_irecv"):
            dist.batch_isend_irecv(ops)
    with check_device_groups(device=CPU, strict=False) as lenient:
        objects = [None, None]
        dist.all_gather_object(objects, dist.get_rank())
        assert objects == [0, 1]
    (problem,) = lenient.violations
    assert "all_gather_object on a device group: object collectives need a CPU side group" in (
        problem
    )
