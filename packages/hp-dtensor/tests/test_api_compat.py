"""Drop-in compatibility: same objects re-exported, same signatures where we mirror torch."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.distributed.device_mesh as torch_mesh
import torch.distributed.tensor as torch_tensor
import torch.distributed.tensor.debug as torch_debug
import torch.distributed.tensor.experimental as torch_experimental

import hp_dtensor
from hp_dtensor import device

SAME_OBJECTS = [
    ("DTensor", torch_tensor.DTensor),
    ("DeviceMesh", torch_mesh.DeviceMesh),
    ("init_device_mesh", torch_mesh.init_device_mesh),
    ("Shard", torch_tensor.Shard),
    ("Replicate", torch_tensor.Replicate),
    ("Partial", torch_tensor.Partial),
    ("Placement", torch_tensor.Placement),
    ("distribute_tensor", torch_tensor.distribute_tensor),
    ("distribute_module", torch_tensor.distribute_module),
    ("CommDebugMode", torch_debug.CommDebugMode),
    ("implicit_replication", torch_experimental.implicit_replication),
    ("local_map", torch_experimental.local_map),
    ("register_sharding", torch_experimental.register_sharding),
    ("StateDictOptions", torch_sd.StateDictOptions),
]


@pytest.mark.parametrize(("name", "torch_object"), SAME_OBJECTS)
def test_reexports_are_torch_objects(name: str, torch_object: Any) -> None:
    assert getattr(hp_dtensor, name) is torch_object


MIRRORED: list[tuple[Callable[..., Any], Callable[..., Any]]] = [
    (device.init_process_group, dist.init_process_group),
    (device.destroy_process_group, dist.destroy_process_group),
    (hp_dtensor.get_model_state_dict, torch_sd.get_model_state_dict),
    (hp_dtensor.set_model_state_dict, torch_sd.set_model_state_dict),
    (hp_dtensor.get_optimizer_state_dict, torch_sd.get_optimizer_state_dict),
    (hp_dtensor.set_optimizer_state_dict, torch_sd.set_optimizer_state_dict),
    (hp_dtensor.get_state_dict, torch_sd.get_state_dict),
    (hp_dtensor.set_state_dict, torch_sd.set_state_dict),
]


@pytest.mark.parametrize(("ours", "theirs"), MIRRORED, ids=lambda f: f.__qualname__)
def test_signatures_match_torch(ours: Callable[..., Any], theirs: Callable[..., Any]) -> None:
    mine = inspect.signature(ours).parameters
    torch_params = {
        k: v for k, v in inspect.signature(theirs).parameters.items() if not k.startswith("_")
    }
    assert list(mine)[: len(torch_params)] == list(torch_params)
    for name, param in torch_params.items():
        assert mine[name].kind == param.kind, name
        assert mine[name].default == param.default, name
    for name in list(mine)[len(torch_params) :]:  # extensions are keyword-only
        assert mine[name].kind is inspect.Parameter.KEYWORD_ONLY, name
