"""``optimizer.implementation``: TorchTitan's default (``fused``), and the other two still train.

The default is TorchTitan's (``fused``); each value reaches torch's optimizer as its flag. The
fused and multi-tensor kernels run the same AdamW: one process, three steps, equal at 1e-5.
Sharded: ``foreach`` under FSDP at 3 ranks (non-power-of-two, uneven shards) equals its own
one-process run, as ``fused`` does in every other trainer test.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer
from hp_trainer.components.optimizer.containers import OptimizersContainer
from hp_trainer.config import OptimizerConfig


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _job(
    folder: Path, par: dict[str, Any], implementation: str, run: str, local_bs: int
) -> JobConfig:
    raw = _helpers().job(folder, par, run=run, local_bs=local_bs).to_dict()
    raw["optimizer"]["implementation"] = implementation
    return ConfigManager().from_dict(raw)


def _train(
    folder: str, par: dict[str, Any], implementation: str, run: str, local_bs: int = 2
) -> Any:
    trainer = Trainer(_job(Path(folder), par, implementation, run, local_bs))
    try:
        defaults = trainer.optimizers.optimizers[0].defaults
        flags = (defaults["fused"], defaults["foreach"])
        losses = trainer.train()
        return losses, trainer.grad_norms, _helpers().full_state(trainer.model_parts), flags
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("implementation", "flags"),
    [("fused", (True, None)), ("foreach", (None, True)), ("for-loop", (None, False))],
)
def test_each_implementation_reaches_torch_as_its_flag(
    implementation: str, flags: tuple[bool | None, bool | None]
) -> None:
    container = OptimizersContainer(
        [nn.Linear(4, 4)], OptimizerConfig(implementation=implementation)
    )
    defaults = container.optimizers[0].defaults
    assert (defaults["fused"], defaults["foreach"]) == flags


def test_default_is_torchtitans_fused() -> None:
    assert OptimizerConfig().implementation == "fused"
    assert ConfigManager().from_dict({}).optimizer.implementation == "fused"


def test_fused_equals_foreach_in_one_process(tmp_path: Path) -> None:
    fused = _train(str(tmp_path), {}, "fused", "fused")
    foreach = _train(str(tmp_path), {}, "foreach", "foreach")
    assert fused[3] == (True, None)
    assert foreach[3] == (None, True)
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(torch.tensor(fused[0]), torch.tensor(foreach[0]), **close)
    assert fused[2].keys() == foreach[2].keys()
    for name, value in fused[2].items():
        torch.testing.assert_close(value, foreach[2][name], **close, msg=name)


def test_foreach_under_fsdp3_equals_one_process(tmp_path: Path) -> None:
    ref = _train(str(tmp_path), {}, "foreach", "ref-foreach", local_bs=6)  # the global batch
    par = {"data_parallel_shard_degree": 3}
    results = run_distributed(_train, 3, str(tmp_path), par, "foreach", "fsdp3", timeout=120)
    assert all(r[3] == (None, True) for r in results)
    _helpers().assert_matches_reference([r[:3] for r in results], ref[:3], each_rank_whole=True)
