"""Host-sync budgets of the MoE layer, counted with :func:`hp_dtensor.testing.count_host_syncs`.

On an accelerator every host sync stops the CPU until the device catches up, so the overlap of
the dispatch all-to-all with the shared experts (and of the next layer's launch with this one)
disappears. Budgets per MoE layer (the steady state: from the second forward on):

- under expert parallelism (EP 2, EP 3, EP 2 x TP 2): one sync in the forward, the split sizes
  of the token all-to-all (TorchTitan pays the same one), none in the backward; with a capacity
  factor the same;
- on one device: none in a dropless forward; one with a capacity factor (the number of kept
  rows sizes the expert input), or with the per-expert loop (``use_grouped_mm=False``, or
  dtypes ``torch._grouped_mm`` does not take), which splits the rows on the host;
- the permutation kernels: none (the expert-index range check rides on the counting scatter).

The results these paths produce are checked against one process and torch in
``test_ep_parallel.py`` and ``test_ep_blocks.py``; here only the counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

from hp_cp_ep import ExpertParallel, ExpertTensorParallel, MoE, MoEArgs, update_expert_bias
from hp_dtensor.testing import HostSyncCounter, count_host_syncs, distributed, rank_seed

DIM, HIDDEN, TOKENS = 16, 32, 12

_CONFIGS: dict[str, dict[str, Any]] = {
    "dropless": {},
    "dropless_score_before_softmax": {"score_before_experts": True, "score_func": "softmax"},
    "capacity": {"capacity_factor": 1.0},
    "capacity_score_before": {"capacity_factor": 0.5, "score_before_experts": True},
    "aux_loss_groups": {"aux_loss_coeff": 0.01, "num_expert_groups": 2, "num_limited_groups": 1},
}


def _moe(num_experts: int, **overrides: Any) -> MoE:
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
        "route_norm": True,
    }
    options.update(overrides)
    return MoE(MoEArgs(**options), DIM, HIDDEN)


def _step_syncs(moe: MoE) -> tuple[HostSyncCounter, HostSyncCounter]:
    """Syncs of the forward and of the backward of one layer, after a warm-up step."""
    torch.manual_seed(rank_seed(3))
    x, target = torch.randn(2, TOKENS // 2, DIM), torch.randn(2, TOKENS // 2, DIM)
    (moe(x) * target).sum().backward()  # the first forward checks the EP peers once
    with count_host_syncs() as forward:
        out = moe(x)
    loss = (out * target).sum()
    with count_host_syncs() as backward:
        loss.backward()
    return forward, backward


@pytest.mark.parametrize("config", list(_CONFIGS))
def test_one_device_moe_budget(config: str) -> None:
    moe = _moe(4, **_CONFIGS[config])
    forward, backward = _step_syncs(moe)
    budget = 1 if moe.moe_args.capacity_factor is not None else 0
    forward.assert_at_most(budget, what=f"one-device MoE forward ({config})")
    backward.assert_at_most(0, what=f"one-device MoE backward ({config})")
    if budget:  # the one sync: the kept rows, read with the per-expert sizes
        assert forward.by_op == {"tolist": 1}, forward.summary()


def test_one_device_looped_experts_pay_one_sync_for_the_split() -> None:
    moe = _moe(4, use_grouped_mm=False)
    forward, backward = _step_syncs(moe)
    forward.assert_at_most(1, what="MoE forward with the per-expert loop")
    assert forward.by_op == {"tolist": 1}, forward.summary()
    backward.assert_at_most(0, what="MoE backward with the per-expert loop")
    capacity = _moe(4, use_grouped_mm=False, capacity_factor=1.0)
    forward, backward = _step_syncs(capacity)
    forward.assert_at_most(1, what="MoE forward, per-expert loop and capacity: one read")
    backward.assert_at_most(0, what="MoE backward, per-expert loop and capacity")


def _ep_budgets(num_experts: int) -> dict[str, tuple[int, int, dict[str, int]]]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {}
    for name, overrides in [*_CONFIGS.items(), ("looped", {"use_grouped_mm": False})]:
        moe = _moe(num_experts, **overrides)
        torch_parallelize_module(moe.experts, mesh, ExpertParallel())
        forward, backward = _step_syncs(moe)
        forward.assert_at_most(1, what=f"EP MoE forward ({name}), rank {dist.get_rank()}")
        backward.assert_at_most(0, what=f"EP MoE backward ({name}), rank {dist.get_rank()}")
        results[name] = (forward.total, backward.total, dict(forward.by_op))
    # the first forward also checks the peers' expert counts once: two more
    fresh = _moe(num_experts)
    torch_parallelize_module(fresh.experts, mesh, ExpertParallel())
    with count_host_syncs() as first:
        fresh(torch.randn(TOKENS, DIM))
    first.assert_at_most(3, what="the first EP forward (peer check included)")
    return results


@distributed(world_size=2)
def test_expert_parallel_budget_ep2() -> None:
    for forward, _, by_op in _ep_budgets(4).values():
        assert forward == 1
        assert by_op == {"tolist": 1}  # the split sizes of the token all-to-all
    # rows the counts do not cover are refused unless they are a dropped tail
    moe = _moe(4)
    torch_parallelize_module(moe.experts, init_device_mesh("cpu", (2,)), ExpertParallel())
    dispatcher = moe.experts.token_dispatcher
    counts = torch.tensor([1, 0, 2, 1])
    with pytest.raises(ValueError, match=r"counts 4 rows but tokens has 6 .*drop_tail=True"):
        dispatcher.dispatch(torch.randn(6, DIM), counts)
    with pytest.raises(ValueError, match="counts 4 rows but tokens has 3"):
        dispatcher.dispatch(torch.randn(3, DIM), counts, drop_tail=True)
    rows = torch.randn(6, DIM)
    dispatched = dispatcher.dispatch(rows, counts, drop_tail=True)
    back = dispatcher.combine(dispatched.wait(), dispatched)
    assert torch.equal(back, rows[:4])  # identity experts: the kept rows come back in order
    assert dispatched.sizes is not None
    assert sum(dispatched.sizes) == dispatched.wait().shape[0]


@distributed(world_size=3)
def test_expert_parallel_budget_ep3() -> None:
    for forward, _, by_op in _ep_budgets(6).values():
        assert forward == 1
        assert by_op == {"tolist": 1}


def test_expert_bias_update_reads_the_host_once_for_all_layers() -> None:
    layers = torch.nn.ModuleList([_moe(4) for _ in range(3)])
    torch.manual_seed(rank_seed(5))
    x = torch.randn(TOKENS, DIM)
    for layer in layers:
        x = layer(x)
    expected = {f"{i}": layer.tokens_per_expert.clone() for i, layer in enumerate(layers)}
    with count_host_syncs() as syncs:
        loads = update_expert_bias(layers)
    syncs.assert_at_most(1, what="update_expert_bias over 3 MoE layers")
    for name, load in loads.items():
        counts = expected[name]
        assert torch.equal(load.tokens_per_expert, counts)
        assert load.tokens_per_expert.device.type == "cpu"
        assert (load.min, load.max) == (float(counts.min()), float(counts.max()))
        assert load.mean == float(counts.mean())
        assert load.imbalance == float(counts.max()) / float(counts.mean())


@distributed(world_size=4)
def test_expert_tensor_parallel_ep2_tp2_budget() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    for overrides in ({}, {"capacity_factor": 1.0}):
        moe = _moe(4, **overrides)
        torch_parallelize_module(moe.experts, mesh, ExpertTensorParallel())
        torch.manual_seed(7 + mesh.get_local_rank("ep"))  # TP ranks share their tokens
        x, target = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
        (moe(x) * target).sum().backward()
        with count_host_syncs() as forward:
            out = moe(x)
        loss = (out * target).sum()
        with count_host_syncs() as backward:
            loss.backward()
        forward.assert_at_most(1, what=f"EP 2 x TP 2 MoE forward {overrides}")
        assert forward.by_op == {"tolist": 1}
        backward.assert_at_most(0, what=f"EP 2 x TP 2 MoE backward {overrides}")
