"""``fully_shard(mesh=<full SPMD mesh>, dp_mesh_dims=...)`` against torch's and plain FSDP."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed

DIM = 8
HIDDEN = 16


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.up.weight
        if isinstance(weight, DTensor):  # SPMD: the input is replicated over the whole mesh
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
        y = self.down(F.relu(self.up(x)))
        if isinstance(y, DTensor):
            y = y.redistribute(placements=[Replicate()] * y.device_mesh.ndim).to_local()
        assert isinstance(y, torch.Tensor)
        return y


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _distribute(model: nn.Module, mesh: DeviceMesh, tp: bool) -> None:
    """Make every parameter a DTensor on ``mesh``: Replicate on dp, Megatron TP on "tp"."""
    for block in model.modules():
        if not isinstance(block, _MLP):
            continue
        plan = {
            "up.weight": Shard(0),
            "up.bias": Shard(0),
            "down.weight": Shard(1),
            "down.bias": Replicate(),
        }
        for name, tp_placement in plan.items():
            sub_name, attr = name.split(".")
            sub = getattr(block, sub_name)
            placements: list[Placement] = [Replicate()] * mesh.ndim
            if tp:
                placements[-1] = tp_placement
            param = nn.Parameter(distribute_tensor(getattr(sub, attr).detach(), mesh, placements))
            setattr(sub, attr, param)


def _train(model: nn.Module, steps: int = 3) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(rank_seed(step))  # different data per rank
        x = torch.randn(2, 4, DIM, generator=gen)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _shard(model: nn.Module, shard_fn: object, **kwargs: object) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        shard_fn(block, **kwargs)  # type: ignore[operator]
    shard_fn(model, **kwargs)  # type: ignore[operator]


def _check_equal(ours: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor), name
        assert isinstance(q, DTensor), name
        assert p.device_mesh == q.device_mesh, name
        assert tuple(p.placements) == tuple(q.placements), (name, p.placements, q.placements)
        assert p.to_local().shape == q.to_local().shape, name
        assert torch.equal(p.to_local(), q.to_local()), name


def _pair(
    base: nn.Module, mesh: DeviceMesh, tp: bool, torch_dims_for_ours: bool = False, **dims: Any
) -> tuple[nn.Module, nn.Module]:
    ours, ref = _distributed_copies(base, mesh, tp=tp)
    dims_cls = TorchDims if torch_dims_for_ours else hp_fsdp.DataParallelMeshDims
    _shard(ours, hp_fsdp.fully_shard, mesh=mesh, dp_mesh_dims=dims_cls(**dims))
    _shard(ref, torch_fully_shard, mesh=mesh, dp_mesh_dims=TorchDims(**dims))
    return ours, ref


def _distributed_copies(base: nn.Module, mesh: DeviceMesh, tp: bool) -> tuple[nn.Module, nn.Module]:
    """Two copies of ``base`` with DTensor parameters on ``mesh`` (see ``_distribute``)."""
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    for model in (ours, ref):
        _distribute(model, mesh, tp=tp)
    return ours, ref


def _trained_equal(ours: nn.Module, ref: nn.Module) -> None:
    """Train both the same way and check every parameter bitwise (mesh, placements, values)."""
    _train(ours)
    _train(ref)
    _check_equal(ours, ref)


@distributed(world_size=4, timeout=120)
def test_dp_mesh_dims_matches_torch_and_plain_fsdp() -> None:
    torch.manual_seed(0)
    base = _Model()
    # 2x2 (dp, tp): FSDP over "dp" keeps the TP placements, bitwise equal to torch's.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours, ref = _distributed_copies(base, mesh, tp=True)
    _shard(ours, hp_fsdp.fully_shard, mesh=mesh, dp_mesh_dims=hp_fsdp.DataParallelMeshDims("dp"))
    _shard(ref, torch_fully_shard, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    up = ours.get_parameter("blocks.0.up.weight")
    down = ours.get_parameter("blocks.0.down.weight")
    init_up = base.get_parameter("blocks.0.up.weight")
    assert isinstance(up, DTensor)
    assert isinstance(down, DTensor)
    assert tuple(up.placements) == (_StridedShard(0, split_factor=2), Shard(0))
    assert up.to_local().shape == (HIDDEN // 4, DIM)
    assert tuple(down.placements) == (Shard(0), Shard(1))
    assert down.to_local().shape == (DIM // 2, HIDDEN // 2)
    assert torch.equal(up.full_tensor(), init_up)
    _check_equal(ours, ref)
    _train(ours)
    assert not torch.equal(up.full_tensor(), init_up)
    _train(ref)
    _check_equal(ours, ref)
    # HSDP on a 2x2 (rep, shard) mesh: Replicate over "rep", Shard over "shard", as torch's.
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    ours, ref = _pair(base, mesh2, tp=False, shard="shard", replicate="rep")
    hsdp_up = ours.get_parameter("blocks.0.up.weight")
    assert isinstance(hsdp_up, DTensor)
    assert tuple(hsdp_up.placements) == (Replicate(), Shard(0))
    _trained_equal(ours, ref)
    # A 1-D named "dp_shard" mesh of DTensor parameters equals plain fully_shard on that mesh.
    mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    spmd, plain = copy.deepcopy(base), copy.deepcopy(base)
    _distribute(spmd, mesh1, tp=False)
    _shard(
        spmd, hp_fsdp.fully_shard, mesh=mesh1, dp_mesh_dims=hp_fsdp.DataParallelMeshDims("dp_shard")
    )
    _shard(plain, hp_fsdp.fully_shard, mesh=mesh1)
    _check_equal(spmd, plain)
    _train(spmd)
    _train(plain)
    _check_equal(spmd, plain)
    assert dist.get_world_size() == 4


@distributed(world_size=4, timeout=120)
def test_dp_mesh_dims_several_shard_dims_and_ddp_match_torch() -> None:
    torch.manual_seed(0)
    base = _Model()
    # Two shard dims (dp_shard x cp): one flattened shard axis of 4 ranks, as torch's.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    ours, ref = _pair(base, mesh, tp=False, shard=("dp_shard", "cp"))
    up = ours.get_parameter("blocks.0.up.weight")
    assert isinstance(up, DTensor)
    assert up.device_mesh.mesh_dim_names == ("dp_shard_cp",)
    assert tuple(up.placements) == (Shard(0),)
    assert up.to_local().shape == (HIDDEN // 4, DIM)
    _check_equal(ours, ref)
    _trained_equal(ours, ref)
    # HSDP with two shard dims: (rep, dp_shard x cp), the replicate axis first.
    mesh3 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("rep", "dp_shard", "cp"))
    ours, ref = _pair(base, mesh3, tp=False, shard=("dp_shard", "cp"), replicate="rep")
    up = ours.get_parameter("blocks.0.up.weight")
    assert isinstance(up, DTensor)
    assert tuple(up.placements) == (Replicate(), Shard(0))
    _trained_equal(ours, ref)
    # DDP over "dp" with Megatron TP over "tp": parameters stay whole on dp, gradients averaged
    # (torch's DataParallelMeshDims passed to ours: drop-in).
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours, ref = _pair(base, mesh2, tp=True, torch_dims_for_ours=True, replicate="dp")
    up = ours.get_parameter("blocks.0.up.weight")
    assert isinstance(up, DTensor)
    assert tuple(up.placements) == (Replicate(), Shard(0))
    assert up.to_local().shape == (HIDDEN // 2, DIM)
    _trained_equal(ours, ref)
    copies = [torch.empty_like(up.to_local()) for _ in range(4)]
    dist.all_gather(copies, up.to_local().contiguous())
    assert torch.equal(copies[0], copies[2])  # dp peers hold the same TP shard
    assert not torch.equal(copies[0], copies[1])  # TP peers hold different shards


@distributed(world_size=4, timeout=120)
def test_dp_mesh_dims_with_replicate_params() -> None:
    """replicate_params on a (dp, tp) SPMD mesh: whole on dp; with 2 dp ranks the average of
    an all-reduce equals torch's reduce-scatter bit for bit, so the trained values match."""
    torch.manual_seed(0)
    base = _Model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours, ref = _distributed_copies(base, mesh, tp=True)
    dims = hp_fsdp.DataParallelMeshDims(shard="dp")
    kept = {"blocks.0.up.weight", "blocks.1.down.bias"}
    for block in ours.blocks:  # type: ignore[union-attr]
        mine = {p for n, p in ours.named_parameters() if n in kept} & set(block.parameters())
        hp_fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims, replicate_params=mine)
    hp_fsdp.fully_shard(ours, mesh=mesh, dp_mesh_dims=dims)
    _shard(ref, torch_fully_shard, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    _train(ours)
    _train(ref)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor)
        assert isinstance(q, DTensor)
        if name in kept:  # whole on dp, still TP-sharded: (Replicate(), <tp placement>)
            assert tuple(p.placements) == (Replicate(), q.placements[1]), name
            local_shape = {"blocks.0.up.weight": (HIDDEN // 2, DIM), "blocks.1.down.bias": (DIM,)}
            assert tuple(p.to_local().shape) == local_shape[name], name
            copies = [torch.empty_like(p.to_local()) for _ in range(4)]
            dist.all_gather(copies, p.to_local().contiguous())
            assert torch.equal(copies[0], copies[2]), name  # dp peers agree
        else:
            assert tuple(p.placements) == tuple(q.placements), name
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    assert not torch.equal(
        ours.get_parameter("blocks.0.up.weight").full_tensor(),  # type: ignore[operator]
        base.get_parameter("blocks.0.up.weight"),
    )
    # HSDP dims: replicated parameters are all-reduced over all four dp ranks (a different
    # summation order from torch's reduce-scatter + all-reduce: compare with a tolerance).
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    ours, ref = _distributed_copies(base, mesh2, tp=False)
    hsdp = {"shard": "shard", "replicate": "rep"}
    for block in ours.blocks:  # type: ignore[union-attr]
        hp_fsdp.fully_shard(
            block,
            mesh=mesh2,
            dp_mesh_dims=hp_fsdp.DataParallelMeshDims(**hsdp),
            replicate_params={block.up.weight},
        )
    hp_fsdp.fully_shard(ours, mesh=mesh2, dp_mesh_dims=hp_fsdp.DataParallelMeshDims(**hsdp))
    _shard(ref, torch_fully_shard, mesh=mesh2, dp_mesh_dims=TorchDims(**hsdp))
    _train(ours)
    _train(ref)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor)
        assert isinstance(q, DTensor)
        if name.endswith("up.weight"):
            assert tuple(p.placements) == (Replicate(), Replicate()), name
            assert p.to_local().shape == (HIDDEN, DIM)
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6)


def _distribute_2d(model: nn.Module, mesh: DeviceMesh) -> None:
    """DTensor parameters on a 2-D (ep, tp) mesh; some shard one tensor dim over both axes."""
    plan: dict[str, tuple[Placement, Placement]] = {
        "up.weight": (Shard(0), Shard(0)),
        "up.bias": (Shard(0), Replicate()),
        "down.weight": (Replicate(), Shard(1)),
        "down.bias": (Replicate(), Replicate()),
    }
    for block in model.modules():
        if not isinstance(block, _MLP):
            continue
        for name, placements in plan.items():
            sub_name, attr = name.split(".")
            sub = getattr(block, sub_name)
            tensor = distribute_tensor(getattr(sub, attr).detach(), mesh, list(placements))
            setattr(sub, attr, nn.Parameter(tensor))


@pytest.mark.parametrize("shape", [(2, 2, 1), (2, 1, 2)])
@distributed(world_size=4, timeout=120)
def test_fsdp_over_2d_ep_tp_mesh_matches_torch(shape: tuple[int, int, int]) -> None:
    """DTensor parameters on a 2-D (ep, tp) mesh, FSDP over a separate dp mesh, as torch."""
    torch.manual_seed(0)
    base = _Model()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep", "tp"))
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    for model in (ours, ref):
        _distribute_2d(model, mesh["ep", "tp"])
    _shard(ours, hp_fsdp.fully_shard, mesh=mesh["dp"])
    _shard(ref, torch_fully_shard, mesh=mesh["dp"])
    up = ours.get_parameter("blocks.0.up.weight")
    assert isinstance(up, DTensor)
    assert up.device_mesh.ndim == 3
    assert tuple(up.placements) == (_StridedShard(0, split_factor=2), Shard(0), Shard(0))
    _check_equal(ours, ref)
    _trained_equal(ours, ref)
    assert torch.equal(up.full_tensor(), ref.get_parameter("blocks.0.up.weight").full_tensor())
