"""The distributed test harness: pools, failure reporting, timeouts, state reset, fake backend."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import (
    DistributedTestError,
    DistributedTestTimeoutError,
    distributed,
    fake_world,
    pool_stats,
    rank_seed,
    run_distributed,
)


def _all_reduce_rank_sum() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # the other ranks never join: a hung collective


def _leave_state_behind() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(123)
    # a group made with options is the test's own: destroyed after the job
    dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=60))


def _observe_state() -> tuple[str, bool, int, float, int]:
    return (
        str(torch.get_default_dtype()),
        torch.is_grad_enabled(),
        torch.get_num_threads(),
        float(torch.rand(1).item()),
        len(dist.distributed_c10d._world.pg_map),
    )


def _echo(x: int, *, y: str) -> tuple[int, int, str]:
    return dist.get_rank(), x, y


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_echo, 3, 7, y="a") == [(0, 7, "a"), (1, 7, "a"), (2, 7, "a")]


def test_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_one, 3)
    message = str(info.value)
    assert "rank 1" in message
    assert "boom on purpose" in message
    assert "_fail_on_rank_one" in message  # the traceback
    assert "rank 0 ---" not in message
    # The pool is rebuilt: the next job works.
    assert run_distributed(_all_reduce_rank_sum, 3) == [6.0, 6.0, 6.0]


def test_hung_collective_times_out_and_next_test_passes() -> None:
    # A warm pool first: on a fresh one, rank 1's import of this module alone once took longer
    # than the 3 s budget under load (it was named hung too).
    assert run_distributed(_all_reduce_rank_sum, 2) == [3.0, 3.0]
    start = time.perf_counter()
    with pytest.raises(DistributedTestTimeoutError) as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=3.0)
    assert time.perf_counter() - start < 15.0
    assert "rank(s) [0]" in str(info.value)
    assert run_distributed(_all_reduce_rank_sum, 2) == [3.0, 3.0]


def test_state_is_reset_between_jobs() -> None:
    before = run_distributed(_observe_state, 2)
    run_distributed(_leave_state_behind, 2)
    after = run_distributed(_observe_state, 2)
    assert before == after
    dtype, grad, threads, _, groups = after[0]
    assert (dtype, grad, threads) == ("torch.float32", True, 1)
    assert groups == before[0][4]


def _mesh_job(destroy: bool) -> tuple[str, int]:
    """A [1, 2] mesh (its size-1 axis is one new group per rank), a DTensor matmul, and the
    number of sharding propagations DTensor could not answer from its caches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hp_dtensor._torch_compat import dtensor_sharding_propagator as propagator

    calls = 0
    original = propagator.propagate_op_sharding_non_cached

    def counting(schema):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return original(schema)

    propagator.propagate_op_sharding_non_cached = counting
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        x = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0), Shard(1)])
        (x @ x.T).sum().full_tensor()
    finally:
        propagator.propagate_op_sharding_non_cached = original
    kept = mesh.get_group("a")
    if destroy:
        dist.destroy_process_group(kept)
    return kept.group_name, calls


def test_plain_groups_are_kept_for_the_next_job() -> None:
    """The second job's equal mesh gets the first job's group (and mesh object: DTensor's
    caches answer it, ``test_testing_mesh_cache.py``); a group a test destroys leaves the cache,
    and DTensor's caches are cleared after it. A group made with a timeout is fresh in each job
    (``test_state_is_reset_between_jobs``)."""
    first = run_distributed(_mesh_job, 2, False)
    second = run_distributed(_mesh_job, 2, True)
    third = run_distributed(_mesh_job, 2, False)
    for a, b, c in zip(first, second, third, strict=True):
        assert b[0] == a[0]  # the kept group
        assert b[1] == 0  # the same shardings answered from the caches
        assert c[0] != b[0]  # destroyed by the test: made again
        assert c[1] > 0  # and the caches naming it were cleared


def test_twenty_small_all_reduce_jobs_at_world_size_four_are_fast() -> None:
    run_distributed(_all_reduce_rank_sum, 4)  # pool start-up, reported separately
    start = time.perf_counter()
    for _ in range(20):
        assert run_distributed(_all_reduce_rank_sum, 4) == [10.0] * 4
    elapsed = time.perf_counter() - start
    startup = [sec for ws, sec in pool_stats().starts if ws == 4][-1]
    print(f"\n20 all-reduce jobs at ws=4: {elapsed:.3f} s (pool start-up {startup:.2f} s)")
    assert elapsed < 10.0


def test_local_functions_are_rejected() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module level"):
        run_distributed(local, 2)


@distributed(world_size=2)
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_decorated_test_runs_on_every_rank(scale: float) -> None:
    assert dist.get_world_size() == 2
    assert torch.get_num_threads() == 1
    torch.manual_seed(rank_seed(0))
    x = torch.rand(3) * scale
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, x)
    assert not torch.equal(gathered[0], gathered[1])  # different data on each rank
    assert torch.equal(gathered[dist.get_rank()], x)


def test_fake_world_builds_large_meshes_in_one_process() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(64, rank=37):
        mesh = init_device_mesh("cpu", (4, 4, 4), mesh_dim_names=("pp", "dp", "tp"))
        assert mesh["tp"].size() == 4
        assert tuple(mesh.get_coordinate() or ()) == (2, 1, 1)
    assert not dist.is_initialized()


def test_rank_seed_differs_per_rank() -> None:
    seeds = run_distributed(rank_seed, 3, 5)
    assert len(set(seeds)) == 3


#: Groups a test keeps referenced past its end (what a leaking test does): destroyed by the
#: harness, but their gloo threads live on while these references do.
_KEPT_GROUPS: list[dist.ProcessGroup] = []


def _leak_groups(count: int, *, in_cycle: bool = False) -> tuple[int, int]:
    """Create ``count`` groups kept referenced: by a module list, or by a garbage cycle."""
    import os

    cycle: list[object] = []
    cycle.append(cycle)
    for _ in range(count):
        # with a timeout: a fresh group each time, not one the worker keeps for the next job
        group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=60))
        dist.all_reduce(torch.ones(1), group=group)
        (cycle if in_cycle else _KEPT_GROUPS).append(group)
    return os.getpid(), len(os.listdir("/proc/self/task"))


def test_pool_with_leaked_gloo_threads_is_collected_then_replaced() -> None:
    """Groups held by garbage cycles are collected (the pool stays); too many threads left
    after the collection: the next job gets a new pool, counted apart from failures."""
    from hp_dtensor.testing._worker import COLLECT_THREADS, SPARE_THREADS

    stats = pool_stats()
    renewals, rebuilds = stats.renewals, stats.rebuilds
    over = COLLECT_THREADS // 3 + 1
    first = run_distributed(_leak_groups, 2, over, in_cycle=True)
    after = run_distributed(_leak_groups, 2, 0)
    assert [pid for pid, _ in after] == [pid for pid, _ in first]  # the same pool
    assert all(now < then - 3 * over + 10 for (_, now), (_, then) in zip(after, first, strict=True))
    assert stats.renewals == renewals
    leaked = run_distributed(_leak_groups, 2, SPARE_THREADS // 3 + 1)  # module-held: stay
    assert [pid for pid, _ in leaked] == [pid for pid, _ in first]
    fresh = run_distributed(_leak_groups, 2, 0)
    assert not {pid for pid, _ in fresh} & {pid for pid, _ in leaked}, (fresh, leaked)
    assert stats.renewals == renewals + 1
    assert stats.rebuilds == rebuilds
