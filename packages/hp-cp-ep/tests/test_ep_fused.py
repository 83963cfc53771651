"""``GroupedExperts(fused=True)`` / ``MoEArgs(fused=True)``: the experts through ``mega_moe``.

Oracle: the same layer unfused (same weights, same tokens). On one device the fused MoE runs
permutation, experts and combine as one ``hp_kernels::mega_moe`` op; with a capacity (or under
expert parallelism) only the experts' compute is fused. Bitwise equal wherever
``torch._grouped_mm`` applies (dim/hidden multiples of 4 in float32); expert parallelism at
3 ranks with different tokens per rank within 1e-6 of the unfused EP run. The fused path reads
nothing on the host (the unfused one-device MoE reads the counts once, to split by expert).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import ExpertParallel, GroupedExperts, MoE, MoEArgs
from hp_dtensor.testing import count_host_syncs, distributed

DIM, HIDDEN = 16, 24


def _pair(**overrides: Any) -> tuple[MoE, MoE]:
    torch.manual_seed(0)
    options: dict[str, Any] = {"num_experts": 4, "top_k": 2, "route_norm": True}
    options.update(overrides)
    plain = MoE(MoEArgs(**options), DIM, HIDDEN)
    fused = MoE(MoEArgs(**options, fused=True), DIM, HIDDEN)
    fused.load_state_dict(plain.state_dict())
    assert fused.experts.fused
    assert not plain.experts.fused
    return plain, fused


def _run(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = moe(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize(
    "options",
    [
        {"score_before_experts": False, "num_shared_experts": 1},
        {"score_before_experts": True, "num_shared_experts": 0, "score_func": "softmax"},
        {"capacity_factor": 1.0},  # capacity: only the experts' compute is fused
    ],
    ids=["weighted-shared", "score-before", "capacity"],
)
def test_fused_moe_is_bitwise_equal_to_unfused(options: dict[str, Any]) -> None:
    plain, fused = _pair(**options)
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    out, grads = _run(plain, x)
    fused_out, fused_grads = _run(fused, x)
    assert torch.equal(fused_out, out)
    assert grads.keys() == fused_grads.keys()
    assert {"experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= grads.keys()
    for name, grad in grads.items():
        assert torch.equal(fused_grads[name], grad), name


def test_fused_routing_reads_nothing_on_the_host() -> None:
    plain, fused = _pair(use_grouped_mm=False)  # the unfused loop splits rows on the host
    x = torch.randn(7, DIM, generator=torch.Generator().manual_seed(2))
    with count_host_syncs() as unfused_syncs:
        plain(x)
    with count_host_syncs() as fused_syncs:
        fused(x).sum().backward()
    assert unfused_syncs.total >= 1
    fused_syncs.assert_at_most(0, what="fused MoE forward + backward")


def test_routed_refuses_unfused_experts() -> None:
    experts = GroupedExperts(DIM, HIDDEN, 3)
    assert not experts.fuses_routing()
    x, idx, p = torch.randn(4, DIM), torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    with pytest.raises(ValueError, match="needs fused=True"):
        experts.routed(x, idx, p, score_before_experts=False)
    with pytest.raises(TypeError, match="fused must be a bool"):
        GroupedExperts(DIM, HIDDEN, 3, fused=1)  # type: ignore[arg-type]


@distributed(world_size=3)
def test_fused_compute_under_expert_parallel_ep3() -> None:
    """EP over 3 ranks (different tokens each): the fused compute path matches the unfused."""
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
    plain, fused = _pair(num_experts=6, top_k=3, num_shared_experts=1)
    parallelize_module(plain.experts, mesh, ExpertParallel())
    parallelize_module(fused.experts, mesh, ExpertParallel())
    assert not fused.experts.fuses_routing()  # distributed experts: compute-only fusion
    x = torch.randn(9, DIM, generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    out, grads = _run(plain, x)
    fused_out, fused_grads = _run(fused, x)
    torch.testing.assert_close(fused_out, out, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_fused_args_with_unfused_replacement_experts_are_refused() -> None:
    """A model that swaps in its own experts (fused=False) cannot silently drop the fusion."""
    _, fused = _pair()
    fused.experts = GroupedExperts(DIM, HIDDEN, 4)
    with pytest.raises(ValueError, match=r"MoEArgs\.fused=True but the experts \(GroupedExperts\)"):
        fused(torch.randn(3, DIM))
