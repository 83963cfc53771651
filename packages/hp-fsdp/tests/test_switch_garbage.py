"""``use_hp_fsdp`` refuses while torch-sharded modules are alive, not while they await collection.

A model sharded by torch's ``fully_shard`` and dropped stays in ``gc.get_objects()`` until the
cyclic garbage collector runs (its modules and FSDP state reference each other). When that
happens depends on how many objects the process allocated since the last collection, so the
switch collects first: a dropped model never blocks it, whatever ran before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

from hp_dtensor.testing import fake_world
from hp_fsdp.integrations import hp_fsdp_active, use_hp_fsdp


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _torch_sharded_names() -> list[str]:
    # type(), not isinstance: some lazy objects warn when asked for __class__
    return [type(o).__name__ for o in gc.get_objects() if type(o).__name__ == "FSDPDroppedNet"]


class DroppedNet(torch.nn.Sequential):
    """A model sharded by torch and dropped (a class name no other test uses)."""


def test_dropped_torch_sharded_model_does_not_block_the_switch(no_automatic_gc: None) -> None:
    with fake_world(2, rank=0):
        model = DroppedNet(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        torch_fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        del model
        assert _torch_sharded_names(), "the dropped model should await collection (a cycle)"
        with use_hp_fsdp():
            assert hp_fsdp_active()
    assert not hp_fsdp_active()
    assert not _torch_sharded_names()


def test_live_torch_sharded_model_still_blocks_the_switch(no_automatic_gc: None) -> None:
    with fake_world(2, rank=0):
        model = DroppedNet(torch.nn.Linear(4, 4))
        torch_fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(RuntimeError, match=r"already sharded by torch's fully_shard are alive"):
            use_hp_fsdp()
        assert not hp_fsdp_active()
        del model
