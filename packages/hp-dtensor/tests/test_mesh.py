"""Mesh context: init_mesh, use_mesh/get_current_mesh, sub-meshes and flattening."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import (
    DTensor,
    Replicate,
    distribute_tensor,
    flatten_axes,
    get_current_mesh,
    get_submesh,
    init_device_mesh,
    init_mesh,
    mesh_axis_size,
    use_mesh,
)
from hp_dtensor.testing import distributed, fake_world, rank_seed


def test_init_mesh_defaults_to_detected_device_and_validates() -> None:
    with fake_world(8, rank=6):
        mesh = init_mesh((2, 4), ("dp", "tp"))
        assert mesh.device_type == "cpu"
        assert mesh.mesh_dim_names == ("dp", "tp")
        assert tuple(mesh.get_coordinate() or ()) == (1, 2)
        assert init_mesh(8).shape == (8,)
        with pytest.raises(ValueError, match=r"has 6 ranks but the world size is 8"):
            init_mesh((2, 3))
        with pytest.raises(ValueError, match="one name per axis"):
            init_mesh((2, 4), ("dp",))
        with pytest.raises(ValueError, match="must be unique"):
            init_mesh((2, 4), ("dp", "dp"))
        with pytest.raises(ValueError, match="positive sizes"):
            init_mesh((0, 8))


def test_current_mesh_context_nests_and_restores() -> None:
    with fake_world(8, rank=3):
        outer = init_mesh((8,), ("dp",))
        inner = init_mesh((2, 4), ("dp", "tp"))
        assert get_current_mesh(required=False) is None
        with pytest.raises(RuntimeError, match="no device mesh is current"):
            get_current_mesh()
        with use_mesh(outer) as entered:
            assert entered is outer
            assert get_current_mesh() is outer
            with use_mesh(inner):
                assert get_current_mesh() is inner
                # torch's own factories see it too
                t = distribute_tensor(torch.ones(2), placements=[Replicate(), Replicate()])
                assert t.device_mesh is inner
            assert get_current_mesh() is outer
        assert get_current_mesh(required=False) is None
        with inner:  # torch's ``with mesh:`` is visible as well
            assert get_current_mesh() is inner
        with pytest.raises(TypeError, match="expects a DeviceMesh"), use_mesh("dp"):  # type: ignore[arg-type]
            pass
        with pytest.raises(RuntimeError, match="boom"), use_mesh(outer):
            raise RuntimeError("boom")
        assert get_current_mesh(required=False) is None


def test_submesh_flatten_and_sizes_on_fake_world() -> None:
    with fake_world(8, rank=5):
        mesh = init_mesh((2, 2, 2), ("pp", "dp", "tp"))  # rank 5 = coordinate (1, 0, 1)
        tp = get_submesh(mesh, "tp")
        assert tp.mesh.tolist() == [4, 5]
        dp_tp = get_submesh(mesh, ("dp", "tp"))
        assert dp_tp.mesh.tolist() == [[4, 5], [6, 7]]
        flat = flatten_axes(mesh, ("dp", "tp"))
        assert flat.mesh_dim_names == ("dp_tp",)
        assert flat.mesh.tolist() == [4, 5, 6, 7]
        named = flatten_axes(mesh, ["pp", "dp"], "batch")
        assert named.mesh.tolist() == [1, 3, 5, 7]
        assert mesh_axis_size(mesh, "tp") == 2
        assert mesh_axis_size(mesh, "pp") == 2
        with pytest.raises(ValueError, match=r"unknown mesh axis name\(s\) \['cp'\]"):
            get_submesh(mesh, "cp")
        with pytest.raises(ValueError, match="must not repeat"):
            flatten_axes(mesh, ("dp", "dp"))
        with pytest.raises(ValueError, match="at least one"):
            get_submesh(mesh, ())
        unnamed = init_device_mesh("cpu", (8,))
        with pytest.raises(ValueError, match="has no mesh_dim_names"):
            get_submesh(unnamed, "dp")


@distributed(world_size=4)
def test_flattened_axis_reduces_over_the_right_ranks() -> None:
    mesh = init_mesh((2, 2), ("dp", "tp"))
    flat = flatten_axes(mesh, ("dp", "tp"))
    torch.manual_seed(rank_seed(0))
    value = torch.randn(3)
    total = value.clone()
    dist.all_reduce(total, group=flat.get_group())
    expected = value.clone()
    dist.all_reduce(expected)  # the flattened axis spans the whole world
    assert torch.equal(total, expected)
    with use_mesh(get_submesh(mesh, "tp")):
        dt = distribute_tensor(value, placements=[Replicate()])
        assert isinstance(dt, DTensor)
        assert dt.device_mesh.mesh.tolist() == get_submesh(mesh, "tp").mesh.tolist()
