"""MoE capacity over the expert-parallel group, and DeepSeek-V3's sequence-wise auxiliary loss.

Oracles: one process holding the batch of every rank (capacity, sequence loss under data
parallelism) and a hand-written per-sequence loop (the sequence loss' definition). Every rank
routes a *different* number of tokens; the gate is skewed so expert 0 overflows its capacity.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

from hp_cp_ep import ExpertParallel, MoE, MoEArgs
from hp_cp_ep.ep.router import load_balancing_loss, sequence_balancing_loss
from hp_dtensor.testing import count_host_syncs, distributed

DIM, HIDDEN = 16, 32
TOL: dict[str, Any] = {"rtol": 1e-6, "atol": 1e-6}


def _skewed_moe(num_experts: int, **overrides: Any) -> MoE:
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
        "route_norm": True,
        "load_balance_coeff": None,
    }
    options.update(overrides)
    moe = MoE(MoEArgs(**options), DIM, HIDDEN).double()
    with torch.no_grad():
        gate = moe.router.gate.weight
        gate[0] = gate[0].abs() + 0.5
        gate[-1] = -gate[-1].abs() - 0.5
    return moe


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``5 + 3 * rank`` tokens and output weights (uneven over ranks)."""
    gen = torch.Generator().manual_seed(300 + rank)
    n = 5 + 3 * rank
    x = torch.randn(n, DIM, generator=gen, dtype=torch.float64) + 0.5
    return x, torch.randn(n, DIM, generator=gen, dtype=torch.float64)


def _full_grads(moe: MoE) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in moe.named_parameters():
        assert param.grad is not None, name
        grad = param.grad
        if isinstance(grad, DTensor):
            grads[name] = grad.full_tensor()  # experts: every rank's tokens already summed
        else:
            grad = grad.clone()
            dist.all_reduce(grad)  # router and shared experts: this rank's share
            grads[name] = grad
    return grads


def _capacity_parity(scope: str) -> bool:
    """EP over the world vs one process; whether outputs and drop sets match on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _skewed_moe(world * 2, capacity_factor=1.0, capacity_scope=scope)
    moe = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch_parallelize_module(moe.experts, mesh, ExpertParallel())
    x, target = _tokens(rank)
    out = moe(x)
    (out * target).sum().backward()
    keep = moe._capacity_mask(moe.router(x)[1])

    batches = [_tokens(r) for r in range(world)]
    all_x = torch.cat([b[0] for b in batches])
    all_target = torch.cat([b[1] for b in batches])
    ref_out = reference(all_x)
    (ref_out * all_target).sum().backward()
    ref_keep = reference._capacity_mask(reference.router(all_x)[1])
    assert not ref_keep.all()  # the skewed gate overflows expert 0: choices are dropped
    start = sum(5 + 3 * r for r in range(rank))
    mine = slice(start, start + x.shape[0])
    same_out = torch.allclose(out, ref_out[mine], **TOL)
    same_keep = torch.equal(keep, ref_keep[mine])
    if scope == "ep_group":
        torch.testing.assert_close(out, ref_out[mine], **TOL)
        assert same_keep
        grads = _full_grads(moe)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, **TOL, msg=name)
    agree = torch.tensor([int(same_out and same_keep)])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree)


@distributed(world_size=2)
def test_group_capacity_equals_one_process_ep2() -> None:
    assert _capacity_parity("ep_group")
    # the old per-rank capacity drops other choices: the test can tell the two apart
    assert not _capacity_parity("local")


@distributed(world_size=3)
def test_group_capacity_equals_one_process_ep3() -> None:
    assert _capacity_parity("ep_group")
    assert not _capacity_parity("local")


@distributed(world_size=2)
def test_group_capacity_keeps_one_host_sync() -> None:
    moe = _skewed_moe(4, capacity_factor=1.0, capacity_scope="ep_group")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch_parallelize_module(moe.experts, mesh, ExpertParallel())
    x, target = _tokens(dist.get_rank())
    (moe(x) * target).sum().backward()  # the first forward checks the EP peers once
    with count_host_syncs() as forward:
        out = moe(x)
    loss = (out * target).sum()
    with count_host_syncs() as backward:
        loss.backward()
    forward.assert_at_most(1, what="EP 2 MoE forward, group capacity")
    assert forward.by_op == {"tolist": 1}, forward.summary()
    backward.assert_at_most(0, what="EP 2 MoE backward, group capacity")


def _reference_sequence_loss(
    scores: torch.Tensor, selected: torch.Tensor, num_experts: int, seq_len: int
) -> torch.Tensor:
    """DeepSeek-V3 eqs. 17-20, one sequence and one expert at a time, summed over sequences."""
    top_k = selected.shape[1]
    total = scores.new_zeros(())
    for start in range(0, scores.shape[0], seq_len):
        s = scores[start : start + seq_len]
        chosen = selected[start : start + seq_len]
        normalised = s / s.sum(dim=1, keepdim=True)
        for i in range(num_experts):
            f_i = num_experts / (top_k * seq_len) * float((chosen == i).sum())
            p_i = normalised[:, i].mean()
            total = total + f_i * p_i
    return total


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_loss_matches_hand_written_definition(score_func: str) -> None:
    moe = _skewed_moe(
        4, aux_loss_coeff=0.1, aux_loss_type="sequence", score_func=score_func
    ).train()
    reference = copy.deepcopy(moe)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, DIM, generator=gen, dtype=torch.float64)  # varied routing
    target = torch.randn(3, 7, DIM, generator=gen, dtype=torch.float64)
    (moe(x) * target).sum().backward()

    routing = reference.router.route(x.reshape(-1, DIM), reference.expert_bias)
    expected: torch.Tensor = (
        _reference_sequence_loss(routing.scores, routing.selected_experts, 4, 7) / 3
    )
    assert moe.aux_loss is not None
    torch.testing.assert_close(moe.aux_loss, expected.detach(), **TOL)
    batch = load_balancing_loss(routing.scores, routing.selected_experts, 4)
    assert not torch.allclose(batch, expected)  # a different loss from the batch-wise one
    # gradient: the task loss of the layer without aux plus 0.1 * the hand-written loss
    plain = copy.deepcopy(reference)
    plain.moe_args = dataclasses.replace(moe.moe_args, aux_loss_coeff=0.0)
    (plain(x) * target).sum().backward()
    (aux_grad,) = torch.autograd.grad(expected * 0.1, reference.router.gate.weight)
    task_grad = plain.router.gate.weight.grad
    assert task_grad is not None
    gate = task_grad + aux_grad
    torch.testing.assert_close(moe.router.gate.weight.grad, gate, **TOL)


def test_sequence_loss_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="aux_loss_type must be 'batch' or 'sequence'"):
        MoE(MoEArgs(num_experts=4, aux_loss_type="token"), DIM, HIDDEN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_scope must be 'local' or 'ep_group'"):
        MoE(MoEArgs(num_experts=4, capacity_scope="world"), DIM, HIDDEN)  # type: ignore[arg-type]
    scores = torch.rand(6, 4)
    with pytest.raises(ValueError, match="seq_len=4 must be positive and divide the 6"):
        sequence_balancing_loss(scores, scores.topk(2).indices, 4, 4)


def _sequence_dp_parity() -> None:
    """Data parallel: rank r holds 1 + r sequences; shares add up to one process' loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _skewed_moe(4, aux_loss_coeff=0.1, aux_loss_type="sequence").train()
    moe = copy.deepcopy(reference)
    moe.aux_loss_group = dist.group.WORLD

    def batch(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(70 + r)
        shape = (1 + r, 6, DIM)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        return x, torch.randn(shape, generator=gen, dtype=torch.float64)

    x, target = batch(rank)
    (moe(x) * target).sum().backward()
    assert moe.aux_loss is not None
    share = moe.aux_loss.clone()
    dist.all_reduce(share)
    grads = _full_grads(moe)

    batches = [batch(r) for r in range(world)]
    all_x, all_target = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    (reference(all_x) * all_target).sum().backward()
    assert reference.aux_loss is not None
    torch.testing.assert_close(share, reference.aux_loss, **TOL)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, **TOL, msg=name)


@distributed(world_size=2)
def test_sequence_loss_data_parallel_equals_one_process_dp2() -> None:
    _sequence_dp_parity()


@distributed(world_size=3)
def test_sequence_loss_data_parallel_equals_one_process_dp3() -> None:
    _sequence_dp_parity()
