"""Layout <-> placements, against hand-written torch placements and index arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import _StridedShard

from hp_dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from hp_dtensor.layout import Layout, distribute_with_layout, from_local_with_layout
from hp_dtensor.testing import distributed, fake_world, rank_seed

HAND_WRITTEN: list[
    tuple[
        tuple[int, ...], tuple[str, ...], tuple[object, ...], dict[str, str], tuple[Placement, ...]
    ]
] = [
    ((4,), ("dp",), ("dp", "None"), {}, (Shard(0),)),
    ((4,), ("dp",), ("None", "dp"), {}, (Shard(1),)),
    ((4,), ("dp",), ("None", "None"), {}, (Replicate(),)),
    ((4,), ("dp",), ("None",), {"dp": "sum"}, (Partial("sum"),)),
    ((2, 2), ("dp", "tp"), ("None", "tp"), {}, (Replicate(), Shard(1))),
    ((2, 2), ("dp", "tp"), ("dp", "tp"), {}, (Shard(0), Shard(1))),
    ((2, 2), ("dp", "tp"), ("tp", "dp"), {}, (Shard(1), Shard(0))),
    ((2, 2), ("dp", "tp"), (("dp", "tp"), "None"), {}, (Shard(0), Shard(0))),
    (
        (2, 2),
        ("dp", "tp"),
        (("tp", "dp"), "None"),
        {},
        (_StridedShard(0, split_factor=2), Shard(0)),
    ),
    ((2, 2), ("dp", "tp"), ("dp", "None"), {"tp": "max"}, (Shard(0), Partial("max"))),
    ((2, 2, 2), ("pp", "dp", "tp"), ("tp", ("pp", "dp")), {}, (Shard(1), Shard(1), Shard(0))),
    (
        (2, 2, 2),
        ("pp", "dp", "tp"),
        ("None", "None"),
        {"dp": "avg"},
        (Replicate(), Partial("avg"), Replicate()),
    ),
    (
        (2, 3, 2),
        ("a", "b", "c"),
        (("c", "a", "b"), "None"),
        {},
        (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2), Shard(0)),
    ),
]


@pytest.mark.parametrize(("shape", "names", "tensor_map", "partial", "expected"), HAND_WRITTEN)
def test_placements_match_hand_written(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    tensor_map: tuple[object, ...],
    partial: dict[str, str],
    expected: tuple[Placement, ...],
) -> None:
    layout = Layout(shape, names)(*tensor_map, partial=partial)  # type: ignore[arg-type]
    assert layout.placements == expected
    with fake_world(len(layout.rank_list), rank=len(layout.rank_list) - 1):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        back = Layout.from_placements(mesh, expected, len(tensor_map))
        assert back == layout
        assert back.placements == expected
        assert back.device_mesh is mesh


def _nested_chunk(
    x: torch.Tensor, order: tuple[str, ...], coord: dict[str, int], sizes: dict[str, int]
) -> torch.Tensor:
    for alias in order:
        x = x.chunk(sizes[alias], dim=0)[coord[alias]]
    return x


@pytest.mark.parametrize("rank", [0, 5, 11])
def test_every_axis_order_shards_as_stated_on_a_3d_mesh(rank: int) -> None:
    shape, names = (2, 3, 2), ("a", "b", "c")
    sizes = dict(zip(names, shape, strict=True))
    with fake_world(12, rank=rank):
        base = Layout(shape, names)
        mesh = base.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        coord = dict(zip(names, coordinate, strict=True))
        x = torch.arange(48.0).reshape(24, 2)
        for k in (1, 2, 3):
            for order in itertools.permutations(names, k):
                layout = base(order, "None")
                got = distribute_tensor(x, mesh, layout.placements, src_data_rank=None)
                assert torch.equal(got.to_local(), _nested_chunk(x, order, coord, sizes)), order
                assert Layout.from_placements(mesh, layout.placements, 2).tensor_map == (order, ())


def test_big_mesh_round_trip_on_fake_world() -> None:
    with fake_world(64, rank=37):
        base = Layout((4, 4, 4), ("dp", "cp", "tp"))
        layout = base(("tp", "dp"), "cp", "None", partial=None)
        mesh = layout.device_mesh
        assert mesh.shape == (4, 4, 4)
        assert layout.placements == (_StridedShard(0, split_factor=4), Shard(1), Shard(0))
        again = Layout.from_placements(mesh, layout.placements, 3)
        assert again == layout


def test_repr_and_dict_round_trip() -> None:
    base = Layout((2, 2), ("dp", "tp"), rank_list=[3, 2, 1, 0])
    layout = base(("tp", "dp"), "None", partial=None)
    assert (
        repr(base) == "Layout(mesh_shape=(2, 2), alias_name=('dp', 'tp'), rank_list=[3, 2, 1, 0])"
    )
    assert repr(layout).endswith("tensor_map=(('tp', 'dp'), 'None'))")
    data = layout.to_dict()
    assert data == {
        "mesh_shape": [2, 2],
        "alias_name": ["dp", "tp"],
        "rank_list": [3, 2, 1, 0],
        "tensor_map": [["tp", "dp"], "None"],
        "partial": {},
    }
    assert Layout.from_dict(data) == layout
    assert Layout.from_dict(base.to_dict()) == base
    partial = Layout((2,), ("dp",))("None", partial={"dp": "sum"})
    assert "partial={'dp': 'sum'}" in repr(partial)
    assert layout.ndim == 2
    assert layout.is_tensor_layout
    assert not base.is_tensor_layout
    assert hash(Layout.from_dict(data)) == hash(layout)


def test_errors_are_clear() -> None:
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="unknown mesh axis alias 'pp'"):
        base("pp", "None")
    with pytest.raises(ValueError, match=r"used more than once"):
        base("dp", "dp")
    with pytest.raises(ValueError, match=r"used more than once"):
        base(("dp", "tp"), "tp")
    with pytest.raises(ValueError, match=r"used more than once"):
        base("dp", "None", partial={"dp": "sum"})
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        base("dp", "None", partial={"tp": "mean"})
    with pytest.raises(ValueError, match="one reduce op for all partial axes"):
        base("None", partial={"dp": "sum", "tp": "max"})
    with pytest.raises(ValueError, match="one tensor-map entry per tensor dim"):
        base()
    with pytest.raises(TypeError, match="alias or a tuple of aliases"):
        base(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="this is a device layout"):
        _ = base.placements
    with pytest.raises(ValueError, match="rank_list has 3 ranks but mesh_shape"):
        Layout((2, 2), ("dp", "tp"), rank_list=[0, 1, 2])
    with pytest.raises(ValueError, match="distinct non-negative"):
        Layout((2, 2), ("dp", "tp"), rank_list=[0, 1, 1, 2])
    with pytest.raises(ValueError, match="must name each of the 2 axes"):
        Layout((2, 2), ("dp",))
    with pytest.raises(ValueError, match="must be unique"):
        Layout((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="reserved"):
        Layout((2,), ("None",))
    with pytest.raises(ValueError, match="positive sizes"):
        Layout((0,), ("dp",))
    with pytest.raises(TypeError, match="must be strings"):
        Layout((2,), (1,))  # type: ignore[arg-type]
    with fake_world(4, rank=1):
        with pytest.raises(ValueError, match="outside the world of size 4"):
            Layout((2, 2), ("dp", "tp"), rank_list=[0, 1, 2, 7])
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(ValueError, match="got 2 placements for a 1-D mesh"):
            Layout.from_placements(mesh, [Shard(0), Shard(0)], 1)
        with pytest.raises(ValueError, match="out of range for a 1-D tensor"):
            Layout.from_placements(mesh, [Shard(2)], 1)
        assert Layout.from_placements(mesh, [Shard(-1)], 2).tensor_map == ((), ("axis0",))
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="match no order of the mesh axes"):
            Layout.from_placements(mesh2d, [_StridedShard(0, split_factor=3), Shard(0)], 1)
        layout = Layout((4,), ("dp",))("dp")
        with pytest.raises(ValueError, match="for 1-D tensors, got a 2-D one"):
            distribute_with_layout(torch.zeros(2, 2), layout)


# --- distributed ---------------------------------------------------------------------------------


def _check_distribute(
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    entries: tuple[object, ...],
    partial: dict[str, str],
) -> None:
    layout = Layout(mesh_shape, names)(*entries, partial=partial)  # type: ignore[arg-type]
    torch.manual_seed(rank_seed(3))  # different data per rank: rank 0's must win
    x = torch.randn(7, 5)
    source = x.clone()
    dist.broadcast(source, src=0)
    got = distribute_with_layout(x, layout)
    assert isinstance(got, DTensor)
    assert got.shape == (7, 5)
    assert got.placements == layout.placements
    assert torch.equal(got.full_tensor(), source)  # exact, also through Partial axes
    if not partial:
        mesh = layout.device_mesh
        reference = distribute_tensor(source, mesh, layout.placements, src_data_rank=None)
        assert torch.equal(got.to_local(), reference.to_local())
    # wrap the local shard again: the global shape is inferred exactly (uneven shards)
    again = from_local_with_layout(got.to_local(), layout)
    assert again.shape == (7, 5)
    assert torch.equal(again.full_tensor(), source)


@pytest.mark.parametrize(
    ("entries", "partial"),
    [
        (("x", "None"), {}),
        (("None", "x"), {}),
        (("None", "None"), {"x": "sum"}),
    ],
)
@distributed(world_size=3)
def test_distribute_and_from_local_ws3(
    entries: tuple[object, ...], partial: dict[str, str]
) -> None:
    _check_distribute((3,), ("x",), entries, partial)


@pytest.mark.parametrize(
    ("entries", "partial"),
    [
        (("dp", "tp"), {}),
        ((("tp", "dp"), "None"), {}),
        ((("dp", "tp"), "None"), {}),
        (("None", ("tp", "dp")), {}),
        (("dp", "None"), {"tp": "sum"}),
        (("None", "None"), {"dp": "sum", "tp": "sum"}),
        (("None", "dp"), {"tp": "product"}),
    ],
)
@distributed(world_size=4)
def test_distribute_and_from_local_2x2(
    entries: tuple[object, ...], partial: dict[str, str]
) -> None:
    _check_distribute((2, 2), ("dp", "tp"), entries, partial)


@distributed(world_size=3)
def test_from_local_infers_uneven_global_shape_ws3() -> None:
    rank = dist.get_rank()
    torch.manual_seed(rank_seed(4))
    local = torch.randn((4, 4, 2)[rank], 3)  # torch.chunk's uneven split of 10 rows
    layout = Layout((3,), ("dp",))("dp", "None")
    dt = from_local_with_layout(local, layout)
    assert dt.shape == (10, 3)
    pieces: list[torch.Tensor | None] = [None] * 3
    dist.all_gather_object(pieces, local)
    assert torch.equal(dt.full_tensor(), torch.cat([p for p in pieces if p is not None]))
    explicit = from_local_with_layout(local, layout, shape=(10, 3))
    assert explicit.stride() == (3, 1)
    with pytest.raises(ValueError, match=r"this rank should hold \(3, 3\)"):
        from_local_with_layout(torch.zeros(4, 3), layout, shape=(9, 3))
