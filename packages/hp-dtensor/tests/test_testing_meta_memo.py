"""Pool workers memoize DTensor's output-metadata propagation by global metadata.

The oracle is DTensor's own propagation: every answer the memo gave while the same ops ran in
two layouts of the same global tensors (a 2 x 2 mesh, other placements the second time: DTensor's
sharding cache misses, the memo hits) is computed again by DTensor and is equal. Values are
checked against plain tensors; the memo empties with DTensor's caches. A call with a plain
tensor argument or a spec without plain-int metadata (a trace's symbolic sizes) has no key.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dtensor.testing import distributed

SHAPES = [(8, 6), (6, 4), (6,)]
LAYOUTS = [
    [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Replicate())],
    [(Replicate(), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Replicate())],
]


def _ops(a: DTensor, b: DTensor, c: DTensor) -> list[torch.Tensor]:
    out = torch.mm(a, b)
    out = torch.relu(out + 1.0)
    summed = out.sum(dim=0)
    both = torch._foreach_add([a, c], [a, c])
    # the same op on three shapes: a key without the shapes would answer with another's
    rows = [torch.relu(t) for t in (a, b, c)]
    return [t.full_tensor() for t in (out, summed, *both, *rows)]


def _plain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    out = torch.relu(torch.mm(a, b) + 1.0)
    return [out, out.sum(dim=0), a + a, c + c, *(torch.relu(t) for t in (a, b, c))]


@distributed(world_size=4, fresh_meshes=True)
def test_memoized_metadata_equals_dtensors_own() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hp_dtensor._torch_compat import dtensor_sharding_propagator
    from hp_dtensor.testing import _worker

    caches = _worker.CACHES
    assert caches is not None
    memo = caches.metas
    assert memo.original is not None, "the workers run with the memo installed"
    assert len(memo) == 0  # fresh_meshes: DTensor's caches, and the memo, were cleared
    original = memo.original
    answered: list[tuple[Any, Any]] = []
    memoized = dtensor_sharding_propagator._propagate_tensor_meta_non_cached

    def recorded(op_schema: Any) -> Any:
        hits = memo.hits
        result = memoized(op_schema)
        if memo.hits > hits:
            answered.append((op_schema, result))
        return result

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    full = [torch.randn(s) for s in SHAPES]
    dtensor_sharding_propagator._propagate_tensor_meta_non_cached = recorded
    try:
        for layout in LAYOUTS:
            tensors = [
                distribute_tensor(t, mesh, list(p)) for t, p in zip(full, layout, strict=True)
            ]
            for got, want in zip(_ops(*tensors), _plain(*full), strict=True):
                torch.testing.assert_close(got, want)
    finally:
        dtensor_sharding_propagator._propagate_tensor_meta_non_cached = memoized
    # the second layout: DTensor's cache missed, the memo answered from the first one's
    assert len(answered) >= 4, (memo.hits, memo.misses)
    for op_schema, result in answered:
        assert result == original(op_schema), op_schema.op
    _worker._clear_dtensor_caches()
    assert len(memo) == 0


def test_plain_tensors_and_missing_metadata_have_no_key() -> None:
    from hp_dtensor._torch_compat import DTensorSpec
    from hp_dtensor.testing._expansion_memo import _UnkeyableError
    from hp_dtensor.testing._meta_memo import _meta_key

    spec = DTensorSpec.__new__(DTensorSpec)
    object.__setattr__(spec, "tensor_meta", None)
    for args in ((torch.ones(2),), ([1, torch.ones(1)],), (spec,)):
        with pytest.raises(_UnkeyableError):
            _meta_key(args, DTensorSpec)
    assert _meta_key((1, [2.0, None], "x"), DTensorSpec) == _meta_key(
        (1, [2.0, None], "x"), DTensorSpec
    )
