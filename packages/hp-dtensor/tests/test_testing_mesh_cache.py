"""Pool workers keep device meshes (as objects) and DTensor's sharding caches across jobs.

The oracle for "kept" is torch's own propagator: the number of sharding propagations it could
not answer from its caches (0 in a later job with an equal mesh), and the identity of the mesh
object an op's output names (the job's own mesh: torch's ``fully_shard`` requires it). Every
case that could make a cached entry stale clears the caches and builds new mesh objects: a
destroyed group, a group made with options, a sharding rule registered, and a job that asks for
``fresh_meshes``. An equal mesh built again in one job is the same object.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dtensor.testing import distributed, pool_stats, rank_seed, run_distributed

#: The mesh the previous job of this worker built (compared by identity, never by id()).
_LAST: list[weakref.ref[Any]] = []


def _mesh_job(
    *,
    destroy: bool = False,
    twice: bool = False,
    optioned_group: bool = False,
    rule: bool = False,
    flatten: bool = False,
    destroy_first: bool = False,
) -> dict[str, Any]:
    """A [1, ws] mesh (its size-1 axis: one new group per rank; "b" is the default group), a
    DTensor matmul on it; what the worker's caches did with it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hp_dtensor._torch_compat import dtensor_sharding_propagator as propagator
    from hp_dtensor.testing import _worker

    calls = 0
    original = propagator.propagate_op_sharding_non_cached

    def counting(schema: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(schema)

    ws = dist.get_world_size()
    propagator.propagate_op_sharding_non_cached = counting
    try:
        mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("a", "b"))
        # nothing flattened, and no attribute set, by an earlier job
        fresh_state = not mesh._flatten_mapping and not hasattr(mesh, "test_marker")
        mesh.test_marker = True  # type: ignore[attr-defined]  # what a test may leave on it
        torch.manual_seed(rank_seed(0))
        x = distribute_tensor(torch.randn(4, 6 * ws), mesh, [Replicate(), Shard(1)])
        y = x @ x.T
        assert isinstance(y, DTensor)
        out = y.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    finally:
        propagator.propagate_op_sharding_non_cached = original
    whole = torch.empty(4, 6 * ws)
    dist.all_gather(list(whole.chunk(ws, dim=1)), x.to_local().contiguous())
    torch.testing.assert_close(out, whole @ whole.T)  # same numbers, whatever was cached
    flat_same = None
    if flatten:
        flat = mesh._flatten("ab")
        flat_same = bool(_LAST) and len(_LAST) > 1 and _LAST[1]() is flat
    same = bool(_LAST) and _LAST[0]() is mesh
    _LAST[:] = [weakref.ref(mesh)] + ([weakref.ref(mesh._flatten("ab"))] if flatten else [])
    second = None
    if destroy_first:
        dist.destroy_process_group(mesh.get_group("a"))
    if twice:
        again = init_device_mesh("cpu", (1, ws), mesh_dim_names=("a", "b"))
        second = again is mesh
    if optioned_group:
        dist.new_group(list(range(ws)), timeout=timedelta(seconds=60))
    if rule:
        from hp_dtensor import sharding_rule

        def replicate_only(*args: Any, **kwargs: Any) -> list[Any]:
            return [([Replicate()], [Replicate(), Replicate()])]

        with sharding_rule(torch.ops.aten.mm.default, replicate_only):
            pass
    if destroy:
        dist.destroy_process_group(mesh.get_group("a"))
    caches = _worker.CACHES
    assert caches is not None
    return {
        "same_mesh": same,
        "flat_same": flat_same,
        "output_mesh_is_mine": y.device_mesh is mesh,
        "propagations": calls,
        "fresh_state": fresh_state,
        "second_is_first": second,
        "group": None if destroy or destroy_first else mesh.get_group("a").group_name,
    }


def _run(world_size: int = 2, **kwargs: Any) -> dict[str, Any]:
    results = run_distributed(_mesh_job, world_size, **kwargs)
    assert all(r == results[0] for r in results), results  # every rank hits or misses together
    return results[0]


def test_a_later_job_gets_the_same_mesh_object_and_hits_the_caches() -> None:
    stats = pool_stats()
    _run(destroy=True)  # start from empty caches and no kept mesh
    cleared, kept = stats.caches_cleared, stats.caches_kept
    first = _run()
    second = _run()
    assert (stats.caches_cleared, stats.caches_kept) == (cleared, kept + 2)
    assert not first["same_mesh"]
    assert first["propagations"] > 0
    assert second["same_mesh"]  # the object of the earlier job, initialized again
    assert second["fresh_state"]
    assert second["propagations"] == 0  # every sharding answered from the caches
    assert second["output_mesh_is_mine"]  # the cached specs name this job's mesh
    assert second["group"] == first["group"]


def test_flattened_meshes_are_kept_with_their_root() -> None:
    _run(destroy=True)
    _run(flatten=True)
    again = _run(flatten=True)
    assert again["same_mesh"]
    assert again["flat_same"]
    assert again["fresh_state"]  # the root forgot the earlier job's flattening
    assert again["propagations"] == 0


@pytest.mark.parametrize(
    "stale",
    [
        {"destroy": True},  # the mesh's own group destroyed by the test
        {"optioned_group": True},  # a group with a timeout, destroyed by the harness
        {"rule": True},  # a sharding rule registered (and restored) in the job
    ],
    ids=["destroyed-group", "group-with-options", "rule-registered"],
)
def test_whatever_could_make_an_entry_stale_clears_the_caches(stale: dict[str, bool]) -> None:
    _run(destroy=True)
    cleared = pool_stats().caches_cleared
    reasons = dict(pool_stats().clear_reasons)
    first = _run(**stale)
    assert pool_stats().caches_cleared == cleared + 1
    added = {k: v - reasons.get(k, 0) for k, v in pool_stats().clear_reasons.items()}
    (why,) = [k for k, v in added.items() if v]
    word = {"destroy": "destroyed", "optioned_group": "destroyed", "rule": "rule"}
    assert word[next(iter(stale))] in why, why
    after = _run()
    assert not after["same_mesh"]  # the meshes were forgotten with the caches
    assert after["propagations"] == first["propagations"] > 0
    assert after["output_mesh_is_mine"]
    if stale.get("destroy"):
        assert after["group"] is not None  # a new group, and the op above used it


def test_an_equal_mesh_built_again_in_a_job_is_the_same_object() -> None:
    """A second trainer in one job builds its mesh again: the same object with its state (a new
    equal one would be mixed up with the first by DTensor's caches); after the first's groups
    are destroyed, a new object, and the caches are cleared after the job."""
    _run(destroy=True)
    first = _run(twice=True)
    assert first["second_is_first"] is True
    after = _run()
    assert after["same_mesh"]
    assert after["propagations"] == 0
    gone = _run(twice=True, destroy_first=True)
    assert gone["second_is_first"] is False
    after = _run()
    assert not after["same_mesh"]
    assert after["propagations"] > 0


def test_fresh_meshes_opts_a_job_out() -> None:
    _run(destroy=True)
    _run()
    fresh = run_distributed(_mesh_job, 2, fresh_meshes=True)[0]
    assert not fresh["same_mesh"]
    assert fresh["propagations"] > 0  # started with empty caches
    after = _run()
    assert not after["same_mesh"]  # and ended with them: nothing of it is handed out again
    assert after["propagations"] > 0


def test_meshes_are_kept_at_world_size_three() -> None:
    _run(3, destroy=True)
    first = _run(3)
    second = _run(3)
    assert (first["same_mesh"], second["same_mesh"]) == (False, True)
    assert second["propagations"] == 0 < first["propagations"]


@distributed(world_size=2, fresh_meshes=True)
def test_the_decorator_passes_fresh_meshes() -> None:
    from hp_dtensor.testing import _worker

    caches = _worker.CACHES
    assert caches is not None
    assert not caches.meshes._enabled
