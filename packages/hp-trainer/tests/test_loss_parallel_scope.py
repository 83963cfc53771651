"""Loss parallel is entered around the loss only, not around the model's forward.

``hp_tp.loss_parallel`` is a torch-function mode: inside it, every torch call goes through a
Python handler, a host cost per op on every step. The trainer enters it around the loss (the
mode's backward needs no mode), so under TP it sees the loss call of each micro-batch and
nothing else: with and without pipeline parallel, in training and in validation. The losses
stay those of one process (test_trainer_parity, test_trainer_pp_parity).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F

from hp_dtensor.testing import load_test_module, run_distributed
from hp_tp import loss as tp_loss
from hp_trainer import ConfigManager, Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _calls_under_the_mode(folder: str, par: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Names of the functions the mode saw in 2 training steps, and in one validation."""
    raw = _helpers().job(Path(folder), par, run=f"scope-r{dist.get_rank()}", steps=2).to_dict()
    raw["validation"] = {
        "enable": True, "dataset": raw["data"]["dataset"], "freq": 1000, "steps": 1,
        "local_batch_size": 2,
    }  # fmt: skip
    job = ConfigManager().from_dict(raw)
    seen: list[str] = []
    original = tp_loss._LossParallelMode.__torch_function__

    def counted(self: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(func, "__name__", str(func)))
        return original(self, func, *args, **kwargs)

    tp_loss._LossParallelMode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        trainer = Trainer(job)
        try:
            trainer.train()
            in_training = list(seen)
            seen.clear()
            trainer.validate()
        finally:
            trainer.close()
    finally:
        tp_loss._LossParallelMode.__torch_function__ = original  # type: ignore[method-assign]
    return in_training, seen


def test_under_tp_the_mode_sees_the_loss_calls_only(tmp_path: Path) -> None:
    tp2 = {"tensor_parallel_degree": 2}
    pp2tp2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}
    for world, par in ((2, tp2), (4, pp2tp2)):
        for rank, (training, validation) in enumerate(
            run_distributed(_calls_under_the_mode, world, str(tmp_path), par)
        ):
            # without PP: one loss per micro-batch; with PP the last stage's ranks compute them
            last_stage = "pipeline_parallel_degree" not in par or rank >= world // 2
            names = {F.cross_entropy.__name__}
            assert set(training) == (names if last_stage else set()), (par, rank, training)
            assert len(training) <= 8, (par, rank, training)
            assert set(validation) <= names, (par, rank, validation)
            assert len(validation) <= 4, (par, rank, validation)
            if last_stage:
                assert validation, (par, rank)
