"""Hot-expert replication: training equal to no replication, and a lower per-rank peak load.

Oracle: the same MoE under plain expert parallelism without replicas (itself checked against
one process in ``test_ep_parallel.py``), same weights and data (different on every rank), a gate
skewed so expert 0 takes most choices. Both train 3 SGD steps; after each the replicated one
re-plans from the group's load (as the trainer does every N steps). Observed: parameters and
losses within 1e-6, the rows each rank's experts received (max / mean over ranks falls), the
weight fetch's bytes, and the host syncs (unchanged: one per forward).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import (
    DedupTokenDispatcher,
    ExpertParallel,
    ExpertTensorParallel,
    MoE,
    MoEArgs,
    plan_hot_expert_replicas,
    update_expert_bias,
    update_hot_experts,
)
from hp_dtensor.testing import count_host_syncs, distributed

DIM, HIDDEN, TOKENS = 16, 32, 16
EXACT: dict[str, Any] = {"rtol": 1e-6, "atol": 1e-6}


def _skewed_moe(num_experts: int, **overrides: Any) -> MoE:
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
        "route_norm": True,
        "load_balance_coeff": 0.01,
    }
    options.update(overrides)
    moe = MoE(MoEArgs(**options), DIM, HIDDEN)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.8  # expert 0 (rank 0) takes most choices
    return moe


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + rank + 17 * step)
    return torch.rand(TOKENS, DIM, generator=gen), torch.randn(TOKENS, DIM, generator=gen)


def _peak_over_mean(rows: int) -> float:
    table = torch.tensor([float(rows)])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, table)
    loads = torch.cat(gathered)
    return float(loads.max() / loads.mean())


def _train(num_experts: int, replicas: int, steps: int = 3) -> tuple[MoE, list[float], list[Any]]:
    """3 SGD steps under EP; with ``replicas`` > 0 re-planned after every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    moe = _skewed_moe(num_experts)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(moe.experts, mesh, ExpertParallel())
    opt = torch.optim.SGD(moe.parameters(), lr=0.5)
    losses, peaks = [], []
    for step in range(steps):
        x, target = _batch(rank, step)
        opt.zero_grad()
        loss = (moe(x) * target).sum()
        loss.backward()
        for name, param in moe.named_parameters():  # data parallel: sum the replicated grads
            if not name.startswith("experts."):
                dist.all_reduce(param.grad)
        opt.step()
        losses.append(float(loss.detach()))
        peaks.append(_peak_over_mean(moe.experts.token_dispatcher.last_received_rows))
        loads = update_expert_bias(moe, dist.group.WORLD)
        if replicas:
            update_hot_experts(moe, loads, replicas)
    return moe, losses, peaks


def _equal_training(num_experts: int, replicas: int) -> tuple[list[float], list[float]]:
    plain, plain_losses, plain_peaks = _train(num_experts, 0)
    replicated, losses, peaks = _train(num_experts, replicas)
    dispatcher = replicated.experts.token_dispatcher
    assert 1 <= len(dispatcher.hot_expert_replicas) <= replicas  # copies that help only
    assert dispatcher.hot_expert_replicas[0][0] == 0  # the skewed expert is the hottest
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), **EXACT)
    for name, param in replicated.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        reference = plain.get_parameter(name)
        expected = reference.full_tensor() if isinstance(reference, DTensor) else reference
        torch.testing.assert_close(value, expected, **EXACT, msg=name)
    assert peaks[0] == plain_peaks[0]  # the first step runs before any plan
    return plain_peaks, peaks


@distributed(world_size=2)
def test_hot_expert_replica_trains_like_no_replica_ep2() -> None:
    plain_peaks, peaks = _equal_training(4, replicas=1)
    # the replicated steps spread expert 0's rows over both ranks
    assert all(p < q for p, q in zip(peaks[1:], plain_peaks[1:], strict=True)), (
        plain_peaks,
        peaks,
    )


@distributed(world_size=3)
def test_hot_expert_replicas_train_like_no_replica_ep3() -> None:
    plain_peaks, peaks = _equal_training(6, replicas=2)
    assert all(p < q for p, q in zip(peaks[1:], plain_peaks[1:], strict=True)), (
        plain_peaks,
        peaks,
    )
    # the replicas cost one weight all-to-all per forward, no host sync
    moe, _, _ = _train(6, replicas=2, steps=2)
    x, target = _batch(dist.get_rank(), 5)
    with count_host_syncs() as forward:
        out = moe(x)
    with count_host_syncs() as backward:
        (out * target).sum().backward()
    assert (forward.total, backward.total) == (1, 0), forward.summary()


def test_plan_puts_hot_experts_on_least_loaded_ranks() -> None:
    loads = [50.0, 30.0, 1.0, 1.0, 2.0, 0.0, 10.0, 6.0]  # ranks (ep 4): 80, 2, 2, 16
    assert plan_hot_expert_replicas(loads, 4, 0) == []
    assert plan_hot_expert_replicas(loads, 4, 1) == [(0, 1)]
    assert plan_hot_expert_replicas(loads, 4, 2) == [(0, 1), (1, 2)]
    # expert 6 (rank 3, load 16) could only go to rank 0 (40 after two moves): skipped
    assert plan_hot_expert_replicas(loads, 4, 3) == [(0, 1), (1, 2)]
    assert plan_hot_expert_replicas([5.0, 1.0, 1.0, 4.0], 2, 1) == []  # 5 + 2.5 >= 6: no help
    assert plan_hot_expert_replicas(loads, 1, 2) == []  # one rank: nowhere to copy to
    with pytest.raises(ValueError, match=r"num_replicas must be in \[0, 8\], got 9"):
        plan_hot_expert_replicas(loads, 4, 9)
    with pytest.raises(ValueError, match="do not divide over ep_size=3"):
        plan_hot_expert_replicas(loads, 3, 1)
    with pytest.raises(ValueError, match="needs an expert-parallel group"):
        _skewed_moe(4).experts.token_dispatcher.replicate_hot_experts(loads[:4], 1)
    with pytest.raises(ValueError, match="needs an expert-parallel group"):
        DedupTokenDispatcher(4).replicate_hot_experts(loads[:4], 1)


@distributed(world_size=2)
def test_replica_plans_that_differ_fail_on_every_rank() -> None:
    moe = _skewed_moe(4)
    parallelize_module(moe.experts, init_device_mesh("cpu", (2,)), ExpertParallel())
    loads = [9.0, 1.0, 1.0, 1.0] if dist.get_rank() == 0 else [1.0, 1.0, 9.0, 1.0]
    with pytest.raises(ValueError, match="ranks computed different plans"):
        moe.experts.token_dispatcher.replicate_hot_experts(loads, 1)
    clone = copy.deepcopy(moe)  # still without replicas: the failed plan was not installed
    assert clone.experts.token_dispatcher.hot_expert_replicas == []


def _one_step_equal(etp: bool, dedup: bool = False, **overrides: Any) -> None:
    """One forward and backward with a replica of expert 0 equals the same without (1e-6)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = _skewed_moe(4, **overrides)
    replicated = copy.deepcopy(plain)
    if etp:  # EP 2 x TP 2: the replica carries each TP rank's slice of the hidden units
        mesh = init_device_mesh("cpu", (2, 2))
        x, target = _batch(mesh.get_local_rank(0), 0)
        for moe in (plain, replicated):
            parallelize_module(moe.experts, mesh, ExpertTensorParallel())
    else:
        mesh = init_device_mesh("cpu", (world,))
        x, target = _batch(rank, 0)
        for moe in (plain, replicated):
            parallelize_module(moe.experts, mesh, ExpertParallel(dedup=dedup))
    dispatcher = replicated.experts.token_dispatcher
    assert dispatcher.replicate_hot_experts([50.0, 1.0, 1.0, 1.0], 1) == [(0, 1)]
    outputs, rows = [], []
    for moe in (plain, replicated):
        out = moe(x)
        (out * target).sum().backward()
        outputs.append(out.detach())
        rows.append(moe.experts.token_dispatcher.last_received_rows)
    torch.testing.assert_close(outputs[1], outputs[0], **EXACT)
    ep_rank = mesh.get_local_rank(0)
    # the owner of expert 0 (EP rank 0) computes fewer rows, its replica's rank (1) more
    assert (rows[1] < rows[0]) if ep_rank == 0 else (rows[1] > rows[0]), (ep_rank, rows)
    for name, param in replicated.named_parameters():
        grad, expected = param.grad, plain.get_parameter(name).grad
        assert grad is not None
        assert expected is not None
        if isinstance(grad, DTensor):
            assert isinstance(expected, DTensor)
            grad, expected = grad.full_tensor(), expected.full_tensor()
        torch.testing.assert_close(grad, expected, **EXACT, msg=name)


@distributed(world_size=2)
def test_replicas_with_capacity_drops_and_the_per_expert_loop() -> None:
    _one_step_equal(False, capacity_factor=1.0, score_before_experts=True)
    _one_step_equal(False, use_grouped_mm=False, top_k=3)
    # de-duplicated dispatch: a hot expert's choices alternate between its two copies
    _one_step_equal(False, dedup=True, top_k=3)
    _one_step_equal(False, dedup=True, capacity_factor=1.0, score_before_experts=True)


@distributed(world_size=4)
def test_replicas_under_expert_tensor_parallel() -> None:
    _one_step_equal(True)
