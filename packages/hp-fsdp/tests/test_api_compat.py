"""Drop-in compatibility: every FSDP2 name of torch exists in hp_fsdp with the same signature.

The list is explicit because ``torch.distributed.fsdp.__all__`` mixes in FSDP1. Parameters must
match by name, kind, order and default; hp_fsdp may add keyword-only parameters at the end.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch.distributed._composable import replicate_with_fsdp as torch_replicate
from torch.distributed.fsdp._fully_shard import _fsdp_common as torch_common
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fully_shard

import hp_fsdp

FSDP2_NAMES = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
PRIVATE_FSDP2_NAMES = {
    "get_cls_to_fsdp_cls": torch_fully_shard.get_cls_to_fsdp_cls,
    "disable_fsdp_module_new_init": torch_fully_shard.disable_fsdp_module_new_init,
    "FSDPMeshInfo": torch_common.FSDPMeshInfo,
    "HSDPMeshInfo": torch_common.HSDPMeshInfo,
    "DDPMeshInfo": torch_common.DDPMeshInfo,
    "ShardPlacementResult": torch_common.ShardPlacementResult,
    "replicate": torch_replicate.replicate,
}


def _public_methods(cls: type) -> list[str]:
    return sorted(
        name for name, value in vars(cls).items() if not name.startswith("_") and callable(value)
    )


def _same_default(ours: Any, theirs: Any) -> bool:
    """Equal defaults; a policy instance equals torch's when its class name and fields agree."""
    if dataclasses.is_dataclass(theirs) and not isinstance(theirs, type):
        if type(ours).__name__ != type(theirs).__name__:
            return False
        return all(
            getattr(ours, f.name) == getattr(theirs, f.name) for f in dataclasses.fields(theirs)
        )
    return bool(ours == theirs)


def _assert_compatible(ours: Any, theirs: Any, what: str) -> None:
    sig_o = inspect.signature(ours)
    sig_t = inspect.signature(theirs)
    params_o = list(sig_o.parameters.values())
    params_t = list(sig_t.parameters.values())
    assert len(params_o) >= len(params_t), f"{what}: {sig_o} lacks parameters of {sig_t}"
    for po, pt in zip(params_o, params_t, strict=False):
        assert po.name == pt.name, f"{what}: parameter {po.name!r} != torch's {pt.name!r}"
        assert po.kind == pt.kind, f"{what}: {po.name} kind {po.kind} != {pt.kind}"
        assert _same_default(po.default, pt.default), f"{what}: {po.name} default {po.default!r}"
    for extra in params_o[len(params_t) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY, f"{what}: extra {extra} positional"
        assert extra.default is not inspect.Parameter.empty, f"{what}: extra {extra} required"


@pytest.mark.parametrize("name", FSDP2_NAMES)
def test_fsdp2_public_names_match_torch(name: str) -> None:
    assert name in hp_fsdp.__all__
    ours, theirs = getattr(hp_fsdp, name), getattr(torch_fsdp, name)
    _assert_compatible(ours, theirs, name)


@pytest.mark.parametrize("name", sorted(PRIVATE_FSDP2_NAMES))
def test_fsdp2_internal_names_match_torch(name: str) -> None:
    assert name in hp_fsdp.__all__
    _assert_compatible(getattr(hp_fsdp, name), PRIVATE_FSDP2_NAMES[name], name)


def test_fsdp_module_methods_match_torch() -> None:
    methods = _public_methods(torch_fsdp.FSDPModule)
    assert len(methods) >= 20, methods  # the list is torch's, not empty
    for name in methods:
        assert hasattr(hp_fsdp.FSDPModule, name), f"hp_fsdp.FSDPModule lacks {name}"
        _assert_compatible(
            getattr(hp_fsdp.FSDPModule, name), getattr(torch_fsdp.FSDPModule, name), name
        )
    unshard_handle = _public_methods(torch_fsdp.UnshardHandle)
    for name in unshard_handle:
        _assert_compatible(
            getattr(hp_fsdp.UnshardHandle, name), getattr(torch_fsdp.UnshardHandle, name), name
        )


def test_hyperparallel_extensions_exist() -> None:
    for name in ("set_gradient_scaling_factor", "set_reduce_op_type", "load_state_dict"):
        assert callable(getattr(hp_fsdp.HSDPModule, name))
    for name in ("hsdp_sync_stream", "get_hsdp_state", "is_dtensor_managed_param"):
        assert name in hp_fsdp.__all__
    assert callable(hp_fsdp.fully_shard.state)
