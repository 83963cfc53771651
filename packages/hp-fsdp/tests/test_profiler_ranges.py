"""Profiler ranges: one training step of hp-fsdp emits PyTorch FSDP2's ``FSDP::`` ranges."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.profiler import ProfilerActivity, profile

import hp_fsdp
from hp_dtensor.testing import distributed, load_test_module


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


def _fsdp_ranges(model: Any, batch: Any, loss_fn: Any) -> set[str]:
    loss_fn(model, batch).backward()  # warm-up: lazy init, prefetch orders
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model, batch).backward()
    return {e.name for e in prof.events() if e.name.startswith("FSDP::")}


@distributed(world_size=2)
def test_profiler_ranges_match_torch() -> None:
    h = _helpers()
    cfg = h.Config(mesh_shape=(2,), mp="bf16", reshard=True)
    mesh = h.build_mesh(cfg.mesh_shape)
    torch.manual_seed(0)
    base = h.TinyLM()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    h.apply_sharding(ours, hp_fsdp, cfg, mesh)
    h.apply_sharding(theirs, torch_fsdp, cfg, mesh)
    batch = h.make_batch(0)
    names_ours = _fsdp_ranges(ours, batch, h.loss_fn)
    names_theirs = _fsdp_ranges(theirs, batch, h.loss_fn)
    assert "FSDP::all_gather (layers.0)" in names_theirs
    assert names_ours == names_theirs, (
        sorted(names_ours - names_theirs),
        sorted(names_theirs - names_ours),
    )
