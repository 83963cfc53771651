"""Pool workers memoize DTensor's per-mesh strategy expansion; the answers are DTensor's own.

The oracle is DTensor's unmemoized expansion: every call the memo answered during a run of
foreach ops (an AdamW-like update and a gradient norm over a parameter list that repeats shapes,
on a 2 x 2 mesh with mixed placements) is made again on both, and the strategies (output and
input specs, redistribution costs) are equal. Values are checked against plain tensors, a later
answer is a copy (a write into one does not reach the next), and the memo empties with DTensor's
caches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dtensor.testing import distributed, rank_seed

SHAPES = [(8, 6), (8, 6), (6,), (8, 6), (4, 4), (6,)]
PLACEMENTS = [
    (Shard(0), Shard(1)),
    (Shard(0), Shard(1)),
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Shard(0), Shard(1)),
    (Shard(0), Replicate()),
]


def _strategies(result: Any) -> list[Any]:
    return [(s.output_specs, s.input_specs, s.redistribute_cost) for s in result.strategies]


def _step(params: list[DTensor], grads: list[DTensor]) -> list[torch.Tensor]:
    """Foreach ops of an AdamW-like update and a gradient norm."""
    exp_avg = [torch.zeros_like(p) for p in params]
    torch._foreach_mul_(exp_avg, 0.9)
    torch._foreach_add_(exp_avg, grads, alpha=0.1)
    sq = torch._foreach_mul(grads, grads)
    denom = torch._foreach_sqrt(torch._foreach_add(sq, 1e-8))
    torch._foreach_addcdiv_(params, exp_avg, denom, value=-0.01)
    norms = torch._foreach_norm(grads)
    return [n.full_tensor() for n in norms] + [p.full_tensor() for p in params]


@distributed(world_size=4, fresh_meshes=True)
def test_memoized_expansion_equals_dtensors_own() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hp_dtensor._torch_compat import dtensor_ops_utils
    from hp_dtensor.testing import _worker

    caches = _worker.CACHES
    assert caches is not None
    memo = caches.expansions
    original = memo.original
    assert original is not None, "the workers run with the memo installed"
    assert len(memo) == 0  # fresh_meshes: DTensor's caches, and the memo, were cleared
    memoized = dtensor_ops_utils.expand_to_full_mesh_op_strategy
    calls: list[tuple[Any, ...]] = []

    def recorded(mesh: Any, op_schema: Any, strategies: Any, **kwargs: Any) -> Any:
        calls.append((mesh, op_schema, strategies, kwargs))
        return original(mesh, op_schema, strategies, **kwargs)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    full_params = [torch.randn(s) for s in SHAPES]
    torch.manual_seed(rank_seed(1))  # the same on every rank after distribute_tensor's broadcast
    full_grads = [torch.randn(s) for s in SHAPES]
    params = [
        distribute_tensor(t, mesh, list(p)) for t, p in zip(full_params, PLACEMENTS, strict=True)
    ]
    grads = [
        distribute_tensor(t, mesh, list(p)) for t, p in zip(full_grads, PLACEMENTS, strict=True)
    ]
    hits, misses = memo.hits, memo.misses
    memo._original = recorded  # record what DTensor itself is asked (misses only)
    try:
        got = _step(params, grads)
    finally:
        memo._original = original
    assert memo.misses - misses == len(calls) > 0
    # six elements, three distinct (shape, placements): later elements are answered
    assert memo.hits - hits >= len(calls) // 2, (memo.hits - hits, len(calls))
    grads_g = [g.full_tensor() for g in grads]
    plain = [p.clone() for p in full_params]
    exp_avg = [0.1 * g for g in grads_g]
    denom = [torch.sqrt(g * g + 1e-8) for g in grads_g]
    for p, m, d in zip(plain, exp_avg, denom, strict=True):
        p.add_(m / d, alpha=-0.01)
    want = [torch.linalg.vector_norm(g) for g in grads_g] + plain
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # every answer equals DTensor's own, and a later answer is a copy
    for mesh_, op_schema, strategies, kwargs in calls:
        first = memoized(mesh_, op_schema, strategies, **kwargs)
        assert _strategies(first) == _strategies(original(mesh_, op_schema, strategies, **kwargs))
        spec = first.strategies[0]
        spec.redistribute_cost[0].append(123.0)
        spec.input_specs[0].tensor_meta = None
        again = memoized(mesh_, op_schema, strategies, **kwargs)
        assert again.strategies[0] is not spec
        assert 123.0 not in again.strategies[0].redistribute_cost[0]
        assert again.strategies[0].input_specs[0].tensor_meta is not None
    # emptied with DTensor's caches (their meshes may be replaced next)
    _worker._clear_dtensor_caches()
    assert len(memo) == 0


@distributed(world_size=2)
def test_unkeyable_calls_go_to_dtensor() -> None:
    from hp_dtensor._torch_compat import dtensor_ops_utils
    from hp_dtensor.testing import _worker

    caches = _worker.CACHES
    assert caches is not None
    memo = caches.expansions
    original = memo.original
    assert original is not None
    seen: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("is_valid_strategy_cb"))
        return "dtensor's"

    memo._original = recorded
    try:
        size = len(memo)
        cb = lambda *_: True  # noqa: E731 - a callback has no value key
        answer = dtensor_ops_utils.expand_to_full_mesh_op_strategy(
            None, _Schema(), [[Replicate()]], is_valid_strategy_cb=cb
        )
        assert answer == "dtensor's"
        assert seen == [cb]
        assert len(memo) == size
        answer = dtensor_ops_utils.expand_to_full_mesh_op_strategy(
            None, _Schema(args=(torch.ones(1),)), [[Replicate()]]
        )
        assert answer == "dtensor's"
        assert len(seen) == 2
        assert len(memo) == size
    finally:
        memo._original = original


class _Schema:
    """The two fields the memo keys on (an op schema stand-in)."""

    def __init__(self, args: tuple[Any, ...] = ()) -> None:
        self.op = torch.ops.aten.add.Tensor
        self.args_schema = args
        self.kwargs_schema: dict[str, Any] = {}
