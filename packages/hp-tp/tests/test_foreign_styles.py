"""``hp_tp.parallelize_module`` applies styles that follow PyTorch's ``ParallelStyle`` protocol.

A plan may mix hp-tp's styles with torch's own (``torch.distributed.tensor.parallel``) and with any
object that has a callable ``_apply(module, device_mesh)``. Oracle: torch's ``parallelize_module``
with the same plan, bitwise (same redistributions), and a single-process run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.tensor.parallel as torch_tp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import hp_tp
from hp_dtensor.testing import distributed, fake_world


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 24)
        self.down = nn.Linear(24, 12)
        self.norm = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


class _ProtocolOnly:
    """A style that is no ``ParallelStyle`` subclass: it only has ``_apply`` (duck typing)."""

    def __init__(self) -> None:
        self.meshes: list[DeviceMesh] = []

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.meshes.append(device_mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.detach(), device_mesh, (Replicate(),))
            module.register_parameter(name, nn.Parameter(replicated))
        module.register_forward_pre_hook(
            lambda _m, args: tuple(DTensor.from_local(a, device_mesh, (Replicate(),)) for a in args)
        )
        module.register_forward_hook(lambda _m, _args, out: out.to_local())
        return module


@distributed(world_size=2)
def test_torch_and_hp_styles_in_one_plan_match_torch() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    reference = _MLP()
    ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
    hp_tp.parallelize_module(
        ours,
        mesh,
        {
            "up": torch_tp.ColwiseParallel(),  # torch's style
            "down": hp_tp.RowwiseParallel(),  # ours
            "norm": _ProtocolOnly(),  # protocol only
        },
    )
    torch_tp.parallelize_module(
        theirs,
        mesh,
        {"up": torch_tp.ColwiseParallel(), "down": torch_tp.RowwiseParallel()},
    )
    assert ours.up.weight.placements == (Shard(0),)
    assert ours.down.weight.placements == (Shard(1),)
    assert isinstance(ours.norm.weight, DTensor)
    torch.manual_seed(7)  # tensor parallel: every rank sees the same batch
    x = torch.randn(3, 12)
    out, out_torch, out_ref = ours(x), theirs(x), reference(x)
    assert torch.equal(out, out_torch)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    out_torch.square().sum().backward()
    out_ref.square().sum().backward()
    for name in ("up.weight", "up.bias", "down.weight", "down.bias"):
        grad = ours.get_parameter(name).grad
        assert torch.equal(grad.full_tensor(), theirs.get_parameter(name).grad.full_tensor()), name
        torch.testing.assert_close(
            grad.full_tensor(), reference.get_parameter(name).grad, rtol=1e-5, atol=1e-5
        )


def test_foreign_style_gets_nd_mesh_and_is_not_mutated() -> None:
    with fake_world(4):
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        style = _ProtocolOnly()
        model = _MLP()
        hp_tp.parallelize_module(model, mesh2d, {"norm": style}, src_data_rank=None)
        # applied to a copy: the caller's object is untouched (it shares the meshes list)
        assert not hasattr(style, "src_data_rank")
        assert style.meshes == [mesh2d]
        with pytest.raises(ValueError, match="needs a 1-D device mesh, got a 2-D mesh"):
            hp_tp.parallelize_module(
                _MLP(), mesh2d, {"norm": _ProtocolOnly(), "up": hp_tp.ColwiseParallel()}
            )
        with pytest.raises(TypeError, match="parallelize_plan must be"):
            hp_tp.parallelize_module(_MLP(), mesh2d, {"norm": 3})
        with pytest.raises(TypeError, match="got Linear"):  # modules have an unrelated _apply
            hp_tp.parallelize_module(_MLP(), mesh2d, {"norm": nn.Linear(2, 2)})
