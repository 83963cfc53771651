"""Loss parallel is entered around the loss and its backward, not around the model's forward.

``hp_tp.loss_parallel`` is a torch-function mode: inside it, every torch call goes through a
Python handler, a host cost per op on every step. Under TP without PP the trainer enters it
around the loss and ``loss.backward()`` (PyTorch's loss_parallel needs its backward inside; the
autograd engine's ops do not pass the mode), and validation around the loss: the mode sees the
loss's calls and none of the forward's. Under PP the schedule runs the loss and its backward,
so the context still surrounds the schedule's step. The losses stay those of one process
(test_trainer_parity, test_trainer_pp_parity). Tensor parallel 2 on 2 ranks.
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


#: what the loss and its backward call: ``logits.flatten(0, 1).float()``, the targets'
#: flatten, the cross-entropy, the division by the step's tokens and ``loss.backward()``
_LOSS_CALLS = {"flatten", "float", "cross_entropy", "div", "backward"}


def test_under_tp_the_mode_sees_the_loss_calls_only(tmp_path: Path) -> None:
    tp2 = {"tensor_parallel_degree": 2}
    for training, validation in run_distributed(_calls_under_the_mode, 2, str(tmp_path), tp2):
        # 2 steps and the last step's validation; the forward (linear, embedding, ...) unseen
        assert training.count(F.cross_entropy.__name__) == 3, training
        assert set(training) == _LOSS_CALLS, training
        assert validation == ["flatten", "float", "flatten", "cross_entropy"], validation
