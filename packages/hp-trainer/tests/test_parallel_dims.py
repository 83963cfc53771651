"""ParallelDims validation and named meshes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hp_dtensor.testing import distributed, fake_world
from hp_trainer import ParallelDims


def _dims(**kw: int) -> ParallelDims:
    base = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    base.update(kw)
    return ParallelDims(**base)  # type: ignore[arg-type]


def test_dp_shard_is_inferred() -> None:
    assert _dims(tp=2, world_size=8).dp_shard == 4
    d = _dims(dp_replicate=2, tp=3, world_size=12)
    assert (d.dp_shard, d.dp_degree, d.non_data_parallel_size) == (2, 4, 3)
    assert d.fsdp_enabled
    assert d.tp_enabled
    assert d.dp_replicate_enabled
    assert not d.pp_enabled


def test_product_must_match_world_size() -> None:
    with pytest.raises(ValueError, match=r"= 8 != world_size\(6\)"):
        _dims(dp_shard=4, tp=2, world_size=6)
    with pytest.raises(ValueError, match="cannot infer dp_shard"):
        _dims(tp=4, world_size=6)


def test_bad_degrees_rejected() -> None:
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        _dims(tp=0, world_size=4)
    with pytest.raises(ValueError, match="dp_shard must be -1 or >= 1"):
        _dims(dp_shard=-2, world_size=4)


def test_ep_borrows_from_dp_shard_cp_tp() -> None:
    assert _dims(ep=4, tp=2, world_size=8).ep_enabled
    with pytest.raises(ValueError, match=r"ep\(3\) must divide dp_shard\*cp\*tp = 8"):
        _dims(ep=3, world_size=8)


def test_seq_len_divisor() -> None:
    assert _dims(tp=2, world_size=4).seq_len_divisor == 2
    assert _dims(tp=2, cp=2, world_size=8).seq_len_divisor == 8


def test_mesh_before_build_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="build_mesh"):
        _dims(world_size=2).get_mesh("dp")


def test_named_meshes_on_a_fake_world_of_8() -> None:
    with fake_world(8, rank=5):
        d = _dims(dp_replicate=2, tp=2, world_size=8)
        d.build_mesh("cpu")
        assert d.get_mesh("dp").size() == 4
        assert d.get_mesh("dp_shard_cp").size() == 2
        assert d.get_mesh("loss").size() == 4
        assert d.get_mesh("tp").size() == 2
        assert d.get_mesh("fsdp_mesh").mesh_dim_names == ("dp_replicate", "dp_shard")
        assert d.get_optional_mesh("cp") is None
        assert d.get_optional_mesh("ep") is None
        # rank 5 = (dp_replicate 1, dp_shard 0, tp 1) in (dp_replicate, dp_shard, tp) order
        assert d.get_mesh("dp").get_local_rank() == 2
        assert d.get_mesh("tp").get_local_rank() == 1
        with pytest.raises(ValueError, match="unknown mesh 'nope'"):
            d.get_mesh("nope")


@distributed(world_size=4)
def test_meshes_group_the_right_ranks() -> None:
    d = _dims(dp_shard=2, tp=2, world_size=4)
    d.build_mesh("cpu")
    rank = dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(d.get_mesh("tp").get_group())
    dp_ranks = dist.get_process_group_ranks(d.get_mesh("dp").get_group())
    assert tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert dp_ranks == [rank % 2, rank % 2 + 2]


def test_expert_meshes_borrow_from_dp_shard_and_tp() -> None:
    with fake_world(8, rank=5):
        d = _dims(tp=2, ep=4, world_size=8)
        d.build_mesh("cpu")
        assert (d.get_mesh("efsdp").size(), d.get_mesh("ep").size()) == (2, 4)
        # rank 5 is 5th of the flattened dp_shard x tp axis -> (efsdp 1, ep 1)
        assert d.get_mesh("efsdp").get_local_rank() == 1
        assert d.get_mesh("ep").get_local_rank() == 1
