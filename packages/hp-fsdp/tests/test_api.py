"""Single-process checks of the API surface: policies, validation, placements (fake world)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import hp_fsdp
from hp_dtensor.device import is_accelerator
from hp_dtensor.testing import fake_world, load_test_module
from hp_fsdp.param_group import resolve_reshard_after_forward
from hp_fsdp.policies import to_mp_policy, to_offload_policy


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (hp_fsdp.MixedPrecisionPolicy, torch_fsdp.MixedPrecisionPolicy),
        (hp_fsdp.OffloadPolicy, torch_fsdp.OffloadPolicy),
        (hp_fsdp.CPUOffloadPolicy, torch_fsdp.CPUOffloadPolicy),
    ],
)
def test_policy_fields_match_torch(ours: type, theirs: type) -> None:
    def fields(cls: type) -> list[tuple[str, object]]:
        return [(f.name, f.default) for f in dataclasses.fields(cls) if not f.kw_only]

    assert fields(ours) == fields(theirs)
    extras = [f for f in dataclasses.fields(ours) if f.kw_only]
    assert all(f.name not in {g.name for g in dataclasses.fields(theirs)} for f in extras)


def test_torch_policy_instances_are_accepted() -> None:
    theirs = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    assert to_mp_policy(theirs) == hp_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    offload = to_offload_policy(torch_fsdp.CPUOffloadPolicy(pin_memory=False))
    assert offload == hp_fsdp.CPUOffloadPolicy(pin_memory=False)
    assert type(to_offload_policy(torch_fsdp.OffloadPolicy())) is hp_fsdp.OffloadPolicy
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        to_mp_policy("bf16")


def test_reshard_after_forward_resolution(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_reshard_after_forward(True, 4) is True
    assert resolve_reshard_after_forward(False, 4) is False
    assert resolve_reshard_after_forward(4, 4) is True
    assert resolve_reshard_after_forward(2, 4) == 2
    with caplog.at_level(logging.WARNING, logger="hp_fsdp"):
        assert resolve_reshard_after_forward(1, 4) is False
    assert "reshard_after_forward=False" in caplog.text
    for bad in (3, 0, 8):
        with pytest.raises(ValueError, match="divisor"):
            resolve_reshard_after_forward(bad, 4)
    with pytest.raises(ValueError, match="bool, None or an int"):
        resolve_reshard_after_forward(2.0, 4)  # type: ignore[arg-type]


@pytest.mark.skipif(is_accelerator(), reason="pinned memory is available with an accelerator")
def test_pinned_offload_needs_an_accelerator() -> None:
    with pytest.raises(ValueError, match="pin_memory=False"):
        hp_fsdp.fully_shard(nn.Linear(2, 2), offload_policy=hp_fsdp.CPUOffloadPolicy())


def _shard(api: ModuleType, mesh_shape: tuple[int, ...], model: nn.Module) -> None:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model.layers:  # type: ignore[union-attr]
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)


@pytest.mark.parametrize(
    ("world", "rank", "mesh_shape", "placements"),
    [
        (4, 3, (4,), (Shard(0),)),
        (8, 7, (8,), (Shard(0),)),
        (8, 5, (2, 4), (Replicate(), Shard(0))),
    ],
)
def test_placements_and_local_shapes_match_torch(
    world: int, rank: int, mesh_shape: tuple[int, ...], placements: tuple[object, ...]
) -> None:
    h = _helpers()
    with fake_world(world, rank=rank):
        torch.manual_seed(0)
        base = h.TinyLM()
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        _shard(hp_fsdp, mesh_shape, ours)  # type: ignore[arg-type]
        _shard(torch_fsdp, mesh_shape, theirs)  # type: ignore[arg-type]
        assert type(ours).__name__ == "FSDPTinyLM"
        assert isinstance(ours, hp_fsdp.FSDPModule)
        assert isinstance(ours, h.TinyLM)
        assert isinstance(ours.layers[0], hp_fsdp.FSDPModule)
        assert not isinstance(ours, torch_fsdp.FSDPModule)
        assert ours.head.weight is ours.embed.weight  # still tied
        theirs_params = dict(theirs.named_parameters())
        ours_params = dict(ours.named_parameters())
        assert list(ours_params) == list(theirs_params)
        for name, param in ours_params.items():
            other = theirs_params[name]
            assert isinstance(param, DTensor)
            assert isinstance(other, DTensor)
            assert param.placements == other.placements == placements, name
            assert param.to_local().shape == other.to_local().shape, name
            assert torch.equal(param.to_local(), other.to_local()), name
        # uneven vocabulary: torch.chunk semantics (37 rows)
        shard_size = mesh_shape[-1]
        chunk = -(-h.VOCAB // shard_size)
        shard_rank = rank % shard_size
        expected_rows = max(min(chunk, h.VOCAB - chunk * shard_rank), 0)
        assert ours.embed.weight.to_local().shape == (expected_rows, h.DIM)


def test_validation_errors() -> None:
    with fake_world(2, rank=0):
        mesh = init_device_mesh("cpu", (2,))
        with pytest.raises(TypeError, match=r"nn\.Module"):
            hp_fsdp.fully_shard("model", mesh=mesh)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="dp_mesh_dims"):
            hp_fsdp.fully_shard(nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=object())  # type: ignore[call-overload]
        # torch-compatible misuse errors: see test_torch_errors.py
        linear = nn.Linear(4, 4)
        hp_fsdp.fully_shard(linear, mesh=mesh)
        with pytest.raises(TypeError, match="fully_shard was applied"):
            linear.set_modules_to_forward_prefetch([nn.Linear(2, 2)])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="should be a bool"):
            linear.set_reshard_after_forward(2)  # type: ignore[arg-type]


def _params(fn: object) -> list[tuple[str, object, object]]:
    import inspect

    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(
    "method",
    [
        "unshard",
        "reshard",
        "set_is_last_backward",
        "set_requires_gradient_sync",
        "set_requires_all_reduce",
        "set_reshard_after_forward",
        "set_reshard_after_backward",
        "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch",
    ],
)
def test_method_signatures_match_torch(method: str) -> None:
    assert _params(getattr(hp_fsdp.FSDPModule, method)) == _params(
        getattr(torch_fsdp.FSDPModule, method)
    )


def test_fully_shard_signature_matches_torch() -> None:
    ours = _params(hp_fsdp.fully_shard)
    theirs = _params(torch_fsdp.fully_shard)
    # torch's parameters first; hp-fsdp's extensions follow (keyword-only, see test_api_compat)
    assert [(n, k) for n, k, _ in ours[: len(theirs)]] == [(n, k) for n, k, _ in theirs]
    for (name, _, default), (_, _, torch_default) in zip(ours, theirs, strict=False):
        if dataclasses.is_dataclass(torch_default) and not isinstance(torch_default, type):
            for f in dataclasses.fields(torch_default):
                assert getattr(default, f.name) == getattr(torch_default, f.name), name
        else:
            assert default == torch_default, name


def test_apply_gradient_scaling_factor() -> None:
    grad = torch.arange(4.0)
    assert hp_fsdp.apply_gradient_scaling_factor(grad, None) is grad
    assert grad.tolist() == [0.0, 1.0, 2.0, 3.0]
    hp_fsdp.apply_gradient_scaling_factor(grad, 0.5)
    assert grad.tolist() == [0.0, 0.5, 1.0, 1.5]
    half = torch.arange(4.0).to(torch.bfloat16)
    hp_fsdp.apply_gradient_scaling_factor(half, torch.tensor([4.0], dtype=torch.float64))
    assert half.dtype == torch.bfloat16
    assert half.tolist() == [0.0, 4.0, 8.0, 12.0]
    with pytest.raises(ValueError, match="one element"):
        hp_fsdp.apply_gradient_scaling_factor(grad, torch.ones(2))
