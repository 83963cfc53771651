"""SkipDTensorDispatch semantics and custom sharding rules on torch's mechanism."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import (
    DTensor,
    Replicate,
    Shard,
    SkipDTensorDispatch,
    distribute_tensor,
    init_device_mesh,
    register_sharding_rule,
    sharding_rule,
)
from hp_dtensor.testing import distributed, rank_seed


@torch.library.custom_op("hp_dtensor_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("hp_dtensor_test::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@double.register_fake
def _double_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@triple.register_fake
def _triple_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _elementwise_rule(x: Any) -> list[tuple[list[Any], list[Any]]]:
    # one mesh dim: an element-wise op keeps any Shard of its input, or Replicate
    rules: list[tuple[list[Any], list[Any]]] = [([Replicate()], [Replicate()])]
    rules += [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]
    return rules


def _sharded_input() -> tuple[DTensor, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(rank_seed(1))
    full = torch.randn(7, 4)  # uneven over 3 ranks
    dist.broadcast(full, src=0)
    return distribute_tensor(full, mesh, [Shard(0)]), full


@distributed(world_size=3)
def test_skip_dtensor_dispatch_runs_on_local_shards() -> None:
    dt, full = _sharded_input()
    local = dt.to_local().clone()
    global_sum = dt.sum()
    assert isinstance(global_sum, DTensor)
    torch.testing.assert_close(global_sum.full_tensor(), full.sum())
    with SkipDTensorDispatch():
        local_sum = dt.sum()
        shape = dt.shape
        mixed = dt + torch.ones(local.shape)  # a DTensor and a plain tensor: fine, locally
    assert type(local_sum) is torch.Tensor
    assert torch.equal(local_sum, local.sum())
    assert shape == local.shape
    assert type(mixed) is torch.Tensor
    assert torch.equal(mixed, local + 1)
    # outside the block everything is back to normal
    assert isinstance(dt * 2, DTensor)
    # in-place ops write the local shard
    with SkipDTensorDispatch(), torch.no_grad():
        dt.mul_(0.5)
    assert torch.equal(dt.to_local(), local * 0.5)
    # gradients flow back to the DTensor with its placements
    param = torch.nn.Parameter(distribute_tensor(full, dt.device_mesh, [Shard(0)]))
    with SkipDTensorDispatch():
        loss = (param * param).sum()
    loss.backward()
    assert isinstance(param.grad, DTensor)
    assert param.grad.placements == (Shard(0),)
    assert torch.equal(param.grad.to_local(), 2 * param.to_local().detach())


@distributed(world_size=3)
def test_custom_sharding_rule_context_and_registration() -> None:
    dt, full = _sharded_input()
    op = torch.ops.hp_dtensor_test.double.default
    with pytest.raises(Exception, match=r"sharding strategy|Sharding propagation failed"):
        op(dt)
    with sharding_rule(op, _elementwise_rule):
        out = op(dt)
        assert isinstance(out, DTensor)
        assert out.placements == (Shard(0),)
        assert torch.equal(out.to_local(), dt.to_local() * 2)  # no communication needed
        assert torch.equal(out.full_tensor(), full * 2)
    with pytest.raises(Exception, match=r"sharding strategy|Sharding propagation failed"):
        op(dt)  # the rule is gone again
    other = torch.ops.hp_dtensor_test.triple.default
    assert register_sharding_rule([other], _elementwise_rule) is _elementwise_rule
    replicated = dt.redistribute(placements=[Replicate()])
    result = other(replicated)
    assert result.placements == (Replicate(),)
    assert torch.equal(result.to_local(), full * 3)


def test_rule_registration_validates_arguments() -> None:
    with pytest.raises(TypeError, match="operator overload"):
        register_sharding_rule(torch.add, _elementwise_rule)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        register_sharding_rule([], _elementwise_rule)
    with pytest.raises(TypeError, match="rule must be callable"):
        register_sharding_rule(torch.ops.hp_dtensor_test.triple.default, 3)  # type: ignore[arg-type]
