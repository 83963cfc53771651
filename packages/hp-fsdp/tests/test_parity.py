"""Bitwise parity with PyTorch's ``fully_shard``, and closeness to a single process.

Every configuration trains hp-fsdp and torch FSDP2 side by side for 10 AdamW steps on a tiny
transformer with tied embeddings and an uneven vocabulary (37 over 2, 3, 4 ranks), with
different data on every rank, and asserts per rank and per step that losses, sharded
parameters and sharded gradients are bitwise equal.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hp_dtensor.testing import distributed, load_test_module

STEPS = 10


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


WS2 = {
    "fp32": {},
    "bf16": {"mp": "bf16"},
}
WS3 = {
    "fp32": {},
    "bf16": {"mp": "bf16"},
    "grad_accumulation": {"micro_batches": 2},
    "grad_accumulation_bf16": {"micro_batches": 2, "mp": "bf16"},
    "reduce_every_micro_batch": {"micro_batches": 2, "extra": {"reduce_every_micro_batch": True}},
    "cpu_offload": {"offload": True},
    "list_unit": {"list_unit": True},
    "meta_init": {"meta": True},
}
WS4 = {
    "fp32": {},
    "bf16": {"mp": "bf16"},
    "hsdp_fp32": {"mesh_shape": (2, 2)},
    "hsdp_bf16": {"mesh_shape": (2, 2), "mp": "bf16"},
    "hsdp_grad_accumulation": {"mesh_shape": (2, 2), "micro_batches": 2},
    "hsdp_all_reduce_last_micro_batch_only": {
        "mesh_shape": (2, 2),
        "micro_batches": 2,
        "extra": {"all_reduce_last_only": True},
    },
    "reshard_true": {"reshard": True},
    "reshard_false": {"reshard": False},
    "reshard_int2": {"reshard": 2},
    "reshard_int2_bf16": {"reshard": 2, "mp": "bf16"},
}


def _config(world: int, overrides: dict[str, Any]) -> Any:
    h = _helpers()
    kwargs: dict[str, Any] = {"mesh_shape": (world,), "steps": STEPS}
    kwargs.update(overrides)
    return h.Config(**kwargs)


@pytest.mark.parametrize("name", sorted(WS2))
@distributed(world_size=2, timeout=120)
def test_bitwise_parity_with_torch_ws2(name: str) -> None:
    _helpers().run_parity(_config(2, WS2[name]))


@pytest.mark.parametrize("name", sorted(WS3))
@distributed(world_size=3, timeout=120)
def test_bitwise_parity_with_torch_ws3(name: str) -> None:
    _helpers().run_parity(_config(3, WS3[name]))


@pytest.mark.parametrize("name", sorted(WS4))
@distributed(world_size=4, timeout=120)
def test_bitwise_parity_with_torch_ws4(name: str) -> None:
    _helpers().run_parity(_config(4, WS4[name]))


@distributed(world_size=4, timeout=120)
def test_bitwise_parity_with_torch_fsdp_over_tp() -> None:
    h = _helpers()
    configs = [_config(2, {}), _config(2, {"mp": "bf16"})]
    h.run_tp_parity(configs)


@distributed(world_size=2, timeout=120)
def test_matches_single_process_ws2() -> None:
    _helpers().run_oracle(_config(2, {}), 2)


@distributed(world_size=3, timeout=120)
def test_matches_single_process_ws3() -> None:
    _helpers().run_oracle(_config(3, {"micro_batches": 2}), 3)


@distributed(world_size=4, timeout=120)
def test_matches_single_process_hsdp() -> None:
    _helpers().run_oracle(_config(4, {"mesh_shape": (2, 2), "reshard": 2}), 4)
