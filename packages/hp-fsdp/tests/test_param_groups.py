"""Several parameter groups in one unit: ``shard_placement_fn`` -> ``ShardPlacementResult``.

Experts on their own mesh (the MoE layout TorchTitan builds), checked bitwise against torch's
``fully_shard`` with the same placement function, at world sizes 3 and 4.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp_api
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_common as torch_common
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed

DIM = 8
HIDDEN = 12
EXPERTS = 4


class _MoEBlock(nn.Module):
    """A dense projection plus an expert bank; each rank runs the experts it holds locally."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.experts_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.dense(x))
        w_in, w_out = self.experts_in, self.experts_out
        if isinstance(w_in, DTensor):  # expert-parallel: this rank's experts only
            w_in, w_out = w_in.to_local(), w_out.to_local()
        y = torch.relu(torch.einsum("btd,edh->beth", h, w_in))
        return h + torch.einsum("beth,ehd->btd", y, w_out) / w_in.shape[0]


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _is_expert(param: nn.Parameter) -> bool:
    return param.ndim == 3


def _shard(model: _MoE, shard_fn: Callable[..., Any], **kwargs: Any) -> None:
    for block in model.blocks:
        shard_fn(block, **kwargs)
    shard_fn(model, **kwargs)


def _train(model: nn.Module, steps: int = 3, dtype: torch.dtype = torch.float32) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(rank_seed(step))  # different data per rank
        x = torch.randn(2, 5, DIM, generator=gen).to(dtype)
        loss = model(x).float().square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _check_equal(ours: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor), name
        assert isinstance(q, DTensor), name
        assert p.device_mesh == q.device_mesh, (name, p.device_mesh, q.device_mesh)
        assert tuple(p.placements) == tuple(q.placements), (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name


def _placement_fn(
    result_cls: type, info_cls: type, mesh: DeviceMesh, **info: Any
) -> Callable[[nn.Parameter], Any]:
    mesh_info = info_cls(mesh, **info)

    def placement(param: nn.Parameter) -> Any:
        if not _is_expert(param):
            return None
        return result_cls(Shard(list(param.shape).index(HIDDEN)), mesh_info)  # even split

    return placement


def _groups(module: nn.Module) -> list[Any]:
    state = hp_fsdp.get_hsdp_state(module)
    assert state is not None
    return list(state.groups)


@distributed(world_size=3, timeout=120)
def test_experts_on_another_mesh_match_torch_ws3() -> None:
    """Dense parameters sharded over 3 ranks, experts replicated on a 3x1 HSDP mesh; fp32, bf16."""
    torch.manual_seed(0)
    base = _MoE()
    dense_mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (3, 1), mesh_dim_names=("erep", "eshard"))
    hsdp = {"shard_mesh_dim": 1, "replicate_mesh_dim": 0}
    for mp in (None, "bf16"):
        ours, ref = copy.deepcopy(base), copy.deepcopy(base)
        kw: dict[str, Any] = {"mesh": dense_mesh}
        ref_kw: dict[str, Any] = {"mesh": dense_mesh}
        if mp is not None:
            kw["mp_policy"] = hp_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
            ref_kw["mp_policy"] = TorchMP(torch.bfloat16, torch.float32)
        _shard(
            ours,
            hp_fsdp.fully_shard,
            shard_placement_fn=_placement_fn(
                hp_fsdp.ShardPlacementResult, hp_fsdp.HSDPMeshInfo, expert_mesh, **hsdp
            ),
            **kw,
        )
        _shard(
            ref,
            torch_fully_shard,
            shard_placement_fn=_placement_fn(
                torch_common.ShardPlacementResult, torch_common.HSDPMeshInfo, expert_mesh, **hsdp
            ),
            **ref_kw,
        )
        groups = _groups(ours.blocks[0])
        assert len(groups) == 2
        assert [len(g.params) for g in groups] == [2, 2]  # dense weight+bias, then the experts
        assert groups[0].mesh_info.mesh is dense_mesh
        assert groups[1].mesh_info.mesh is expert_mesh
        assert len(_groups(ours)) == 1  # the head: no experts, one group
        expert = ours.blocks[0].experts_in
        assert isinstance(expert, DTensor)
        assert expert.device_mesh == expert_mesh
        assert tuple(expert.placements) == (Replicate(), Shard(2))
        assert expert.to_local().shape == (EXPERTS, DIM, HIDDEN)
        dense = ours.blocks[0].dense.weight
        assert isinstance(dense, DTensor)
        assert dense.to_local().shape == ((3, 3, 2)[dist.get_rank()], DIM)  # 8 rows, 3 ranks
        _check_equal(ours, ref)
        ours_losses = _train(ours)
        ref_losses = _train(ref)
        assert ours_losses == ref_losses
        _check_equal(ours, ref)
        # after the step every group is resharded: only sharded parameters are registered
        for block in ours.blocks:
            for name, param in block.named_parameters():
                assert isinstance(param, DTensor), name
    # Like torch: another mesh object over the unit's own process groups is an error.
    twin = init_device_mesh("cpu", (3,), mesh_dim_names=("twin",))
    for shard_fn, result_cls, info_cls in (
        (hp_fsdp.fully_shard, hp_fsdp.ShardPlacementResult, hp_fsdp.FSDPMeshInfo),
        (torch_fully_shard, torch_common.ShardPlacementResult, torch_common.FSDPMeshInfo),
    ):
        with pytest.raises(ValueError, match="same"):
            shard_fn(
                _MoEBlock(),
                mesh=dense_mesh,
                shard_placement_fn=_placement_fn(result_cls, info_cls, twin, shard_mesh_dim=0),
            )


@distributed(world_size=4, timeout=120)
def test_expert_parallel_experts_on_efsdp_mesh_match_torch_ws4() -> None:
    """TorchTitan's MoE layout: experts are Shard(0) over "ep", FSDP-sharded over "efsdp".

    Dense parameters are sharded over all 4 ranks; experts over the 2 ranks holding the same
    experts. Also the HSDP variant (experts replicated x sharded on a 2x2 mesh) and the
    reshard_after_forward / explicit prefetch paths, all bitwise equal to torch.
    """
    torch.manual_seed(0)
    base = _MoE()
    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    ep_mesh, efsdp_mesh = moe_mesh["ep"], moe_mesh["efsdp"]

    def expert_parallel(model: _MoE) -> None:
        for block in model.blocks:
            for name in ("experts_in", "experts_out"):
                full = getattr(block, name).detach()
                setattr(block, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))

    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    expert_parallel(ours)
    expert_parallel(ref)
    ours_info = hp_fsdp.FSDPMeshInfo(efsdp_mesh, shard_mesh_dim=0)
    ref_info = torch_common.FSDPMeshInfo(efsdp_mesh, shard_mesh_dim=0)
    _shard(
        ours,
        hp_fsdp.fully_shard,
        mesh=dense_mesh,
        shard_placement_fn=lambda p: (
            hp_fsdp.ShardPlacementResult(Shard(0), ours_info) if _is_expert(p) else None
        ),
        reshard_after_forward=True,
    )
    _shard(
        ref,
        torch_fully_shard,
        mesh=dense_mesh,
        shard_placement_fn=lambda p: (
            torch_common.ShardPlacementResult(Shard(0), ref_info) if _is_expert(p) else None
        ),
        reshard_after_forward=True,
    )
    expert = ours.blocks[1].experts_out
    assert isinstance(expert, DTensor)
    assert expert.to_local().shape == (EXPERTS // 4, HIDDEN, DIM)
    _check_equal(ours, ref)
    assert _train(ours) == _train(ref)
    _check_equal(ours, ref)
    full_ours = ours.blocks[1].experts_out.full_tensor()  # type: ignore[operator]
    assert not torch.equal(full_ours, base.blocks[1].experts_out)  # trained

    # HSDP experts (replicate x shard) with torch's own ShardPlacementResult passed to ours.
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    hsdp_info = torch_common.HSDPMeshInfo(hsdp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

    def hsdp_placement(param: nn.Parameter) -> Any:
        return torch_common.ShardPlacementResult(None, hsdp_info) if _is_expert(param) else None

    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    _shard(ours, hp_fsdp.fully_shard, mesh=dense_mesh, shard_placement_fn=hsdp_placement)
    _shard(ref, torch_fully_shard, mesh=dense_mesh, shard_placement_fn=hsdp_placement)
    expert = ours.blocks[0].experts_in
    assert isinstance(expert, DTensor)
    assert tuple(expert.placements) == (Replicate(), Shard(0))
    groups = _groups(ours.blocks[0])
    assert [g.mesh_info.is_hsdp for g in groups] == [False, True]
    # Explicit prefetching reaches every group of the target unit.
    ours.blocks[0].set_modules_to_forward_prefetch([ours.blocks[1]])  # type: ignore[operator]
    ref.blocks[0].set_modules_to_forward_prefetch([ref.blocks[1]])  # type: ignore[operator]
    ours.blocks[1].set_modules_to_backward_prefetch([ours.blocks[0]])  # type: ignore[operator]
    ref.blocks[1].set_modules_to_backward_prefetch([ref.blocks[0]])  # type: ignore[operator]
    assert _train(ours) == _train(ref)
    _check_equal(ours, ref)
    # Per-unit setters reach every group of the unit.
    ours.blocks[0].set_reduce_op_type("sum")  # type: ignore[operator]
    assert [g.options.reduce_op_type for g in _groups(ours.blocks[0])] == ["sum", "sum"]
    ours.blocks[0].unshard()  # type: ignore[operator]
    assert all(g.is_unsharded for g in _groups(ours.blocks[0]))
    ours.blocks[0].reshard()  # type: ignore[operator]
    assert not any(g.is_unsharded for g in _groups(ours.blocks[0]))
    assert dist.get_world_size() == 4


class _RecordedWork:
    """A work handle that records when it is waited for."""

    def __init__(self, work: Any, events: list[str], tag: str) -> None:
        self._work, self._events, self._tag = work, events, tag

    def wait(self, *args: Any) -> Any:
        self._events.append(f"wait {self._tag}")
        return self._work.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _record_all_gathers(events: list[str]) -> Callable[[], None]:
    original = dist.all_gather_single

    def spy(output: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tag = "experts" if inp.numel() >= EXPERTS * DIM * HIDDEN else "dense"
        events.append(f"issue {tag}")
        work = original(output, inp, *args, **kwargs)
        return _RecordedWork(work, events, tag) if work is not None else None

    dist.all_gather_single = spy

    def restore() -> None:
        dist.all_gather_single = original

    return restore


@distributed(world_size=2, timeout=120)
def test_groups_issue_all_gathers_before_waiting_and_prefetch_together() -> None:
    """A two-group unit issues both all-gathers before waiting for either; backward prefetch
    gathers every group of the previous unit; one reduce-scatter per group."""
    torch.manual_seed(0)
    model = _MoE()
    model.head = nn.Identity()  # type: ignore[assignment]  # the root holds no parameters
    dense_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("erep", "eshard"))
    info = hp_fsdp.HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    _shard(
        model,
        hp_fsdp.fully_shard,
        mesh=dense_mesh,
        shard_placement_fn=lambda p: (
            hp_fsdp.ShardPlacementResult(None, info) if _is_expert(p) else None
        ),
    )
    assert [len(_groups(b)) for b in model.blocks] == [2, 2]
    events: list[str] = []
    reduce_scatters: list[int] = []
    original_rs = dist.reduce_scatter_single

    def count_rs(*args: Any, **kwargs: Any) -> Any:
        reduce_scatters.append(1)
        return original_rs(*args, **kwargs)

    restore = _record_all_gathers(events)
    dist.reduce_scatter_single = count_rs
    try:
        x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(rank_seed(0)))
        loss = model(x).square().mean()
        forward = list(events)
        events.clear()
        loss.backward()
        backward = list(events)
    finally:
        restore()
        dist.reduce_scatter_single = original_rs
    pair = ["issue dense", "issue experts", "wait dense", "wait experts"]
    assert forward == pair + pair, forward  # block 0, then block 1
    # block 1 re-gathers both groups, then prefetches both of block 0 (last group first, the
    # order backward reaches them) before block 0's backward waits for them
    prefetch = ["issue experts", "issue dense", "wait dense", "wait experts"]
    assert backward == [*pair, *prefetch], backward
    assert len(reduce_scatters) == 4  # one per group


def _train_accumulating(model: nn.Module, steps: int = 2) -> list[float]:
    """Two micro-batches per step; the first without gradient sync."""
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
            gen = torch.Generator().manual_seed(rank_seed(10 * step + micro))
            loss = model(torch.randn(2, 5, DIM, generator=gen)).square().mean()
            loss.backward()
            losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return losses


@pytest.mark.parametrize("variant", ["int_reshard", "accumulate", "cpu_offload"])
@distributed(world_size=4, timeout=120)
def test_two_group_units_with_runtime_options_match_torch(variant: str) -> None:
    """Dense over 4 ranks, experts HSDP over a 2x2 mesh, with reshard_after_forward=2, no-sync
    gradient accumulation, or CPU offload: bitwise equal to torch."""
    torch.manual_seed(0)
    base = _MoE()
    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("erep", "eshard"))
    hsdp = {"shard_mesh_dim": 1, "replicate_mesh_dim": 0}
    ours_kw: dict[str, Any] = {"mesh": dense_mesh}
    ref_kw: dict[str, Any] = {"mesh": dense_mesh}
    if variant == "int_reshard":
        ours_kw["reshard_after_forward"] = ref_kw["reshard_after_forward"] = 2
    if variant == "cpu_offload":
        ours_kw["offload_policy"] = hp_fsdp.CPUOffloadPolicy(pin_memory=False)
        ref_kw["offload_policy"] = torch_fsdp_api.CPUOffloadPolicy(pin_memory=False)
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    for block in ours.blocks:
        hp_fsdp.fully_shard(
            block,
            shard_placement_fn=_placement_fn(
                hp_fsdp.ShardPlacementResult, hp_fsdp.HSDPMeshInfo, expert_mesh, **hsdp
            ),
            **ours_kw,
        )
    hp_fsdp.fully_shard(ours, **ours_kw)
    for block in ref.blocks:
        torch_fully_shard(
            block,
            shard_placement_fn=_placement_fn(
                torch_common.ShardPlacementResult, torch_common.HSDPMeshInfo, expert_mesh, **hsdp
            ),
            **ref_kw,
        )
    torch_fully_shard(ref, **ref_kw)
    if variant == "int_reshard":
        dense, experts = _groups(ours.blocks[0])
        assert dense.reshard_after_forward == 2  # 1/2 kept between forward and backward
        assert experts.reshard_after_forward is True  # k = 2 is the experts' whole shard axis
    train = _train_accumulating if variant == "accumulate" else _train
    assert train(ours) == train(ref)
    _check_equal(ours, ref)
