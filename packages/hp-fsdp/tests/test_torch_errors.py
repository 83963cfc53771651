"""Misuse raises what PyTorch's ``fully_shard`` raises: its type (or a subclass) and key phrase.

Each row triggers one misuse with ``api`` = ``torch.distributed.fsdp`` and with ``hp_fsdp`` (in
a fake two-rank world; every error fires before a collective), then checks that hp-fsdp's
exception is an instance of PyTorch's exception type and that both messages carry the phrase.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import hp_fsdp
from hp_dtensor.testing import fake_world, load_test_module


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


def _mesh(shape: tuple[int, ...] = (2,), names: tuple[str, ...] | None = None) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


class _Holder(nn.Module):
    def __init__(self, param: nn.Parameter) -> None:
        super().__init__()
        self.weight = param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _reapply(api: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    api.fully_shard(linear, mesh=_mesh())
    api.fully_shard(linear, mesh=_mesh())


def _container(api: ModuleType) -> None:
    api.fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=_mesh())


def _deepcopy(api: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    api.fully_shard(linear, mesh=_mesh())
    copy.deepcopy(linear)


def _mesh_3d(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh((1, 1, 2), ("a", "b", "c")))


def _mesh_2d_unnamed(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh((1, 2)))


def _scalar(api: ModuleType) -> None:
    api.fully_shard(_Holder(nn.Parameter(torch.tensor(1.0))), mesh=_mesh())


def _non_contiguous(api: ModuleType) -> None:
    api.fully_shard(_Holder(nn.Parameter(torch.randn(4, 6).t())), mesh=_mesh())


def _shard_dim_out_of_range(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh(), shard_placement_fn=lambda p: Shard(3))


def _invalid_placement(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh(), shard_placement_fn=lambda p: Replicate())


def _leftover_meta(api: ModuleType) -> None:
    with torch.device("meta"):
        linear = nn.Linear(4, 4)
    api.fully_shard(linear, mesh=_mesh())
    linear(torch.randn(2, 4))


def _stream_with_hsdp(api: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    api.fully_shard(linear, mesh=_mesh((1, 2), ("replicate", "shard")))
    linear.set_all_reduce_hook(lambda t: None, stream=object())


def _tied_in_two_units(api: ModuleType) -> None:
    h = _helpers()
    model = h.TinyLM()
    api.fully_shard(model.head, mesh=_mesh())
    api.fully_shard(model, mesh=_mesh())
    model(h.make_batch(0)[0])


def _reshard_type(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh(), reshard_after_forward="yes")


def _reshard_not_factor(api: ModuleType) -> None:
    api.fully_shard(nn.Linear(4, 4), mesh=_mesh(), reshard_after_forward=3)


def _set_reshard_type(api: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    api.fully_shard(linear, mesh=_mesh())
    linear.set_reshard_after_forward(2)


def _empty_dp_mesh_dims(api: ModuleType) -> None:
    api.DataParallelMeshDims()


def _dp_mesh_dims_unnamed(api: ModuleType) -> None:
    api.fully_shard(
        nn.Linear(4, 4), mesh=_mesh(), dp_mesh_dims=api.DataParallelMeshDims(shard="dp")
    )


def _dp_mesh_dims_unknown_name(api: ModuleType) -> None:
    api.fully_shard(
        nn.Linear(4, 4),
        mesh=_mesh((2,), ("dp",)),
        dp_mesh_dims=api.DataParallelMeshDims(shard="fsdp"),
    )


def _dp_mesh_dims_plain_param(api: ModuleType) -> None:
    api.fully_shard(
        nn.Linear(4, 4),
        mesh=_mesh((2,), ("dp",)),
        dp_mesh_dims=api.DataParallelMeshDims(shard="dp"),
    )


# (name, trigger, PyTorch's key phrase)
CASES: list[tuple[str, Callable[[ModuleType], None], str]] = [
    ("reapply", _reapply, "can only be applied to a module once"),
    ("container", _container, "does not support containers that do not implement forward"),
    ("deepcopy", _deepcopy, "FSDP does not support deepcopy"),
    ("mesh_3d", _mesh_3d, "fully_shard expects a 1D or 2D DeviceMesh"),
    ("mesh_2d_unnamed", _mesh_2d_unnamed, "Please init the 2D mesh for HSDP with mesh_dim_names"),
    ("scalar", _scalar, "fully_shard doesn't support scalar parameters"),
    ("non_contiguous", _non_contiguous, "FSDP does not support non-contiguous parameters"),
    ("shard_dim_out_of_range", _shard_dim_out_of_range, "Shard dim 3 is invalid for 2D tensor"),
    ("invalid_placement", _invalid_placement, "Invalid shard_placement_fn result"),
    ("leftover_meta", _leftover_meta, "should be materialized from meta device before training"),
    ("stream_with_hsdp", _stream_with_hsdp, "stream cannot be set when using native HSDP"),
    ("tied_in_two_units", _tied_in_two_units, "already managed by another FSDP group"),
    ("reshard_type", _reshard_type, "reshard_after_forward should be a bool or an int"),
    ("reshard_not_factor", _reshard_not_factor, "it should be a factor of 2"),
    ("set_reshard_type", _set_reshard_type, "reshard_after_forward should be a bool"),
    ("empty_dp_mesh_dims", _empty_dp_mesh_dims, "At least one of shard or replicate"),
    ("dp_mesh_dims_unnamed", _dp_mesh_dims_unnamed, "mesh must have mesh_dim_names"),
    ("dp_mesh_dims_unknown_name", _dp_mesh_dims_unknown_name, "Mesh dim name 'fsdp' not found"),
    ("dp_mesh_dims_plain_param", _dp_mesh_dims_plain_param, "all parameters must be DTensors"),
]


def _raised(trigger: Callable[[ModuleType], None], api: ModuleType) -> BaseException:
    with fake_world(2, rank=0):
        try:
            trigger(api)
        except Exception as exc:  # the exception is the result under test
            return exc
    raise AssertionError(f"{api.__name__} raised nothing")


@pytest.mark.parametrize(("trigger", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_raises_torch_type_and_phrase(
    trigger: Callable[[ModuleType], None], phrase: str
) -> None:
    theirs = _raised(trigger, torch_fsdp)
    ours = _raised(trigger, hp_fsdp)
    assert phrase in str(theirs), f"the table's phrase is not torch's: {theirs!r}"
    assert isinstance(ours, type(theirs)), (type(ours).__mro__, type(theirs))
    assert phrase in str(ours), f"{ours!r} lacks torch's phrase {phrase!r}"


def test_uneven_inner_dim_is_supported_where_torch_refuses() -> None:
    """torch raises NotImplementedError for Shard(1) of 17 columns over 2 ranks; we shard it."""

    def shard(api: ModuleType) -> nn.Module:
        model = nn.Linear(17, 8)
        api.fully_shard(model, mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.ndim - 1))
        return model

    with fake_world(2, rank=1), pytest.raises(NotImplementedError, match="uneven sharding"):
        shard(torch_fsdp)
    with fake_world(2, rank=1):
        weight = shard(hp_fsdp).weight
        assert weight.placements == (Shard(1),)
        assert weight.to_local().shape == (8, 8)  # chunks of 9 and 8 columns


class _AllGatherExtendedTensor(torch.Tensor):
    """A tensor subclass opting into torch FSDP2's all-gather extension (hooks must not run)."""

    def fsdp_pre_all_gather(self, *args: Any) -> Any:
        raise AssertionError("fully_shard must not all-gather at construction")

    def fsdp_post_all_gather(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("fully_shard must not all-gather at construction")


def test_all_gather_extension_subclass_sharded_as_the_subclass() -> None:
    """Such a parameter is accepted (its hooks run at all-gather time, see
    test_all_gather_extension.py); an uneven inner-dim shard raises torch's error."""
    module = _Holder(nn.Parameter(torch.randn(4, 4).as_subclass(_AllGatherExtendedTensor)))
    with fake_world(2, rank=0):
        hp_fsdp.fully_shard(module, mesh=_mesh())
    assert module.weight._local_tensor.shape == (2, 4)  # hooks not called: no all-gather yet
    module = _Holder(nn.Parameter(torch.randn(4, 5).as_subclass(_AllGatherExtendedTensor)))
    with (
        fake_world(2, rank=0),
        pytest.raises(NotImplementedError, match="does not support uneven sharding on dim 1"),
    ):
        hp_fsdp.fully_shard(module, mesh=_mesh(), shard_placement_fn=lambda p: Shard(1))
