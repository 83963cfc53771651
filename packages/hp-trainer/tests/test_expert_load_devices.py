"""The expert-load tracker's collectives take tensors on their group's device, never objects.

On an NCCL group every collective needs device tensors ("No backend type associated with device
type cpu" otherwise) and object collectives need a host side group; the tracker's stage gather
used ``all_gather_object`` and its set-up flag a host tensor. Here, under pipeline stages that
hold different numbers of MoE layers (1 and 2), every collective the tracker makes is recorded:
its tensors are on :func:`~hp_trainer.components.expert_load.collective_device` of the group, no
object collective runs, and every rank reports every layer's hand-set counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import device as hp_device
from hp_dtensor.testing import run_distributed
from hp_trainer.components import expert_load as expert_load_module
from hp_trainer.components.expert_load import ExpertLoadTracker, collective_device

COUNTS = {
    "layers.0.moe": [3.0, 0, 1, 0, 0, 2, 0, 2],
    "layers.1.moe": [0.0, 4, 0, 0, 4, 0, 0, 0],
    "layers.2.moe": [1.0, 1, 1, 1, 1, 1, 1, 1],
}


def _stages() -> Any:
    from hp_trainer.models.qwen3_moe import Qwen3MoE, qwen3_moe_flavors

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Qwen3MoE(dataclasses.replace(qwen3_moe_flavors["tiny"], n_layers=3))
    keep = ["0"] if rank == 0 else ["1", "2"]  # stage 0: one MoE layer, stage 1: two
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    for name in keep:
        model.layers[name].moe.tokens_per_expert.copy_(torch.tensor(COUNTS[f"layers.{name}.moe"]))
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # no dp

    seen: list[tuple[str, str]] = []
    wrapped = {}
    for op in ("all_reduce", "all_gather", "all_gather_into_tensor"):
        original = getattr(dist, op)

        def record(*args: Any, _op: str = op, _original: Any = original, **kw: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            seen.extend((_op, str(t.device)) for t in tensors)
            return _original(*args, **kw)

        wrapped[op] = original
        setattr(dist, op, record)

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("object collective")

    wrapped["all_gather_object"] = dist.all_gather_object
    dist.all_gather_object = refuse  # type: ignore[assignment]
    try:
        tracker = ExpertLoadTracker([model], alone, pipeline_group=dist.group.WORLD)
        loads = tracker.step()
    finally:
        for op, original in wrapped.items():
            setattr(dist, op, original)
    expected = str(collective_device(dist.group.WORLD))
    return {k: v.tokens_per_expert.tolist() for k, v in loads.items()}, seen, expected


def test_stage_gather_uses_device_tensors_and_no_object_collective() -> None:
    for loads, seen, expected in run_distributed(_stages, 2, timeout=60):
        assert loads == COUNTS  # every rank reports every stage's layers
        assert {op for op, _ in seen} == {"all_reduce", "all_gather"}
        assert all(dev == expected for _, dev in seen), seen


def test_collective_device_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expert_load_module.dist, "get_backend", lambda group=None: "gloo")
    assert collective_device(None) == torch.device(hp_device.DEVICE_TYPE_CPU)
    for backend in (hp_device.BACKEND_NCCL, hp_device.BACKEND_HCCL, "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(expert_load_module.dist, "get_backend", lambda g=None, b=backend: b)
        assert collective_device(None) == hp_device.get_device()
