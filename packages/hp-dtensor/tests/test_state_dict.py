"""State-dict helpers: equal to torch's helpers, and the caller's dicts are never mutated."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hp_dtensor import (
    DTensor,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    init_device_mesh,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from hp_dtensor.testing import distributed, rank_seed


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 5)
        self.frozen = nn.Linear(5, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.down(torch.relu(self.up(x))))


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
        return
    if isinstance(a, list | tuple):  # torch's loading may turn betas=(b1, b2) into a list
        assert isinstance(b, list | tuple), path
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, DTensor):
        assert a.placements == b.placements, path
        assert torch.equal(a.to_local(), b.to_local()), path
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def _snapshot(obj: Any) -> Any:
    """A deep copy to compare against later, plus the identities of the containers and values."""
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(rank_seed(9))  # different data on every rank
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    optim.zero_grad()


def _fsdp_model(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)


@distributed(world_size=3)
def test_fsdp_state_dicts_equal_torch_and_do_not_mutate() -> None:
    mesh = init_device_mesh("cpu", (3,))
    model, optim = _fsdp_model(mesh)
    _train_step(model, optim)
    for options in (
        None,
        StateDictOptions(full_state_dict=True),
        StateDictOptions(full_state_dict=True, cpu_offload=True),
        StateDictOptions(ignore_frozen_params=True),
    ):
        ours = get_model_state_dict(model, options=options)
        _assert_same(ours, torch_sd.get_model_state_dict(model, options=options))
        opt_ours = get_optimizer_state_dict(model, optim, options=options)
        _assert_same(opt_ours, torch_sd.get_optimizer_state_dict(model, optim, options=options))
    assert isinstance(get_model_state_dict(model)["up.weight"], DTensor)
    offloaded = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    assert (len(offloaded) > 0) == (dist.get_rank() == 0)  # torch: only rank 0 keeps the values
    assert "frozen.weight" not in get_model_state_dict(
        model, options=StateDictOptions(ignore_frozen_params=True)
    )

    # load full dicts (broadcast from rank 0) into a fresh model: caller's dicts untouched
    full = StateDictOptions(full_state_dict=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, optim, options=full)
    fresh, fresh_optim = _fsdp_model(mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    given = model_sd if dist.get_rank() == 0 else {}
    before = _snapshot(given)
    given_values = dict(given)
    set_model_state_dict(
        fresh, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    _assert_same(given, before)
    assert all(given[k] is v for k, v in given_values.items())
    _assert_same(get_model_state_dict(fresh), get_model_state_dict(model))
    optim_before = _snapshot(optim_sd)
    set_optimizer_state_dict(fresh, fresh_optim, optim_sd, options=full)
    _assert_same(optim_sd, optim_before)
    _assert_same(
        get_optimizer_state_dict(fresh, fresh_optim), get_optimizer_state_dict(model, optim)
    )
    # a later step of the loaded optimizer does not write into the caller's dict (optim_sd
    # aliases the *source* optimizer's tensors, as torch's getter does: step that one after)
    _train_step(fresh, fresh_optim)
    _assert_same(optim_sd, optim_before)
    _train_step(model, optim)
    _assert_same(get_model_state_dict(fresh), get_model_state_dict(model))


@distributed(world_size=3)
def test_torch_helper_mutates_where_ours_does_not() -> None:
    """The oracle for the test above: torch's set_model_state_dict does replace the values."""
    mesh = init_device_mesh("cpu", (3,))
    model, _ = _fsdp_model(mesh)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh, _ = _fsdp_model(mesh)
    given = dict(full)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    torch_sd.set_model_state_dict(fresh, given, options=options)
    assert any(given[k] is not full[k] for k in full)


@distributed(world_size=4)
def test_hsdp_and_tp_state_dicts_equal_torch() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp, hsdp_optim = _fsdp_model(mesh)
    torch.manual_seed(0)
    tp_model = MLP()
    parallelize_module(
        tp_model, mesh["shard"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    tp_optim = torch.optim.AdamW([p for p in tp_model.parameters() if p.requires_grad], lr=0.1)
    for model, optim in ((hsdp, hsdp_optim), (tp_model, tp_optim)):
        _train_step(model, optim)
        for options in (None, StateDictOptions(full_state_dict=True)):
            model_sd, optim_sd = get_state_dict(model, optim, options=options)
            ref_model_sd, ref_optim_sd = torch_sd.get_state_dict(model, optim, options=options)
            _assert_same(model_sd, ref_model_sd)
            _assert_same(optim_sd, ref_optim_sd)
        sharded_model, sharded_optim = get_state_dict(model, optim)
        model_before, optim_before = _snapshot(sharded_model), _snapshot(sharded_optim)
        set_state_dict(model, optim, model_state_dict=sharded_model, optim_state_dict=sharded_optim)
        _train_step(model, optim)
        _assert_same(sharded_optim, optim_before)  # the step did not write into the caller's dict
        assert set(sharded_model) == set(model_before)


def test_argument_errors() -> None:
    model = MLP()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="options must be a StateDictOptions"):
        get_model_state_dict(model, options={"full_state_dict": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        get_model_state_dict(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_state_dict must be a dict"):
        set_model_state_dict(model, [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optim_state_dict must be a dict"):
        set_optimizer_state_dict(model, optim, None)  # type: ignore[arg-type]
    # single process, plain tensors: same values as torch, and no mutation
    sd = get_model_state_dict(model)
    _assert_same(sd, torch_sd.get_model_state_dict(model))
    before = _snapshot(sd)
    sd["up.weight"] = torch.zeros(10, 6)
    before = _snapshot(sd)
    set_model_state_dict(model, sd)
    _assert_same(sd, before)
    assert torch.equal(model.up.weight, torch.zeros(10, 6))
