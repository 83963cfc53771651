"""The trainer hierarchy and its callbacks.

- A user callback named in the config (``--job.callbacks module:Class``) is imported and checked
  at parse time, built by the trainer, and sees every hook in order with the values the trainer
  logged: ``on_step_values`` with each step's loss (equal to ``trainer.losses``), ``on_log`` on
  the log steps, ``on_validation_end``, ``on_save`` at the checkpoint steps.
- Bad callback specs fail at parse time, naming what was given and what is expected.
- :class:`~hp_trainer.BaseTrainer` is a real base: a subclass that is not a language model
  (a linear regression) trains with the same loop, checkpoints and metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_dtensor.testing import load_test_module
from hp_trainer import (
    BaseTrainer,
    Callback,
    ConfigManager,
    LLMTrainer,
    MetricsCallback,
    MetricsProcessor,
    Trainer,
    parse_args,
)
from hp_trainer.components.checkpoint import CheckpointManager

_h = load_test_module(
    Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
)

RECORDER = """
from hp_trainer import Callback

EVENTS = []


class Recorder(Callback):
    def on_train_begin(self, trainer):
        EVENTS.append(("train_begin", trainer.step))

    def on_step_begin(self, trainer, step):
        EVENTS.append(("step_begin", step))

    def on_step_end(self, trainer, step):
        EVENTS.append(("step_end", step))

    def on_step_values(self, trainer, step, loss, grad_norm):
        EVENTS.append(("values", step, loss, grad_norm))

    def on_log(self, trainer, step, record):
        EVENTS.append(("log", step, record["loss"]))

    def on_validation_end(self, trainer, step, loss, perplexity):
        EVENTS.append(("validation", step, loss))

    def on_save(self, trainer, step):
        EVENTS.append(("save", step))

    def on_train_end(self, trainer):
        EVENTS.append(("train_end", trainer.step))


class Plain:  # no base class: any object with hooks is a callback
    CALLS = 0

    def on_step_end(self, trainer, step):
        Plain.CALLS += 1


class NoHooks:
    pass
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "hp_user_callbacks.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hp_user_callbacks", None)
    import hp_user_callbacks

    yield hp_user_callbacks
    sys.modules.pop("hp_user_callbacks", None)


def test_user_callback_from_the_config_sees_every_hook(tmp_path: Path, user_module: Any) -> None:
    raw = _h.job(tmp_path, {}, run="cb", steps=4).to_dict()
    raw["metrics"]["log_freq"] = 3  # logs at 1, 3, 4
    raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0}
    raw["validation"] = {"enable": True, "freq": 2, "steps": 1, "dataset": raw["data"]["dataset"]}
    path = tmp_path / "job.toml"
    path.write_text(_toml(raw))
    cfg = parse_args(
        [
            "--config",
            str(path),
            "--job.callbacks",
            "hp_user_callbacks:Recorder,hp_user_callbacks:Plain",
        ]
    )
    assert cfg.job.callbacks == ["hp_user_callbacks:Recorder", "hp_user_callbacks:Plain"]
    trainer = Trainer(cfg)
    assert isinstance(trainer, LLMTrainer)
    assert isinstance(trainer, BaseTrainer)
    assert isinstance(trainer.callbacks.callbacks[0], MetricsCallback)  # built-ins first
    losses = trainer.train()
    trainer.close()
    events = user_module.EVENTS
    assert events[0] == ("train_begin", 0)
    assert events[-1] == ("train_end", 4)
    kinds = [e[0] for e in events]
    assert kinds.count("step_begin") == kinds.count("step_end") == 4
    values = [e for e in events if e[0] == "values"]
    assert [e[1] for e in values] == [1, 2, 3, 4]
    assert [e[2] for e in values] == losses
    assert [e[3] for e in values] == trainer.grad_norms
    assert [(e[1], e[2]) for e in events if e[0] == "log"] == [
        (s, losses[s - 1]) for s in (1, 3, 4)
    ]
    assert [e[1] for e in events if e[0] == "validation"] == [2, 4]
    assert [e[1] for e in events if e[0] == "save"] == [2, 4]
    # values of step 2 are read on step 2 (a checkpoint and validation step), before its save
    assert kinds.index("save") > kinds.index("values") + 1
    assert user_module.Plain.CALLS == 4
    # the built-in metrics callback still wrote every step and the validation
    assert [r["step"] for r in trainer.metrics.history if "loss" in r][:3] == [1, 3, 4]


def _toml(raw: dict[str, Any]) -> str:
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f'{key} = "{value}"')
            elif isinstance(value, list):
                lines.append(f"{key} = {value!r}".replace("'", '"'))
            elif value is not None:
                lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon", "'module:Class'"),
        ("hp_no_such_module_x:Cls", "cannot import"),
        ("hp_user_callbacks:Missing", "has no 'Missing'"),
        ("hp_user_callbacks:EVENTS", "must name a class"),
        ("hp_user_callbacks:NoHooks", "defines none of the hooks"),
    ],
)
def test_bad_callbacks_fail_at_parse_time(user_module: Any, spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=r"job\.callbacks") as info:
        parse_args(["--config", "debug", "--job.callbacks", spec])
    assert match in str(info.value)


class _Regression(BaseTrainer):
    """Not a language model: y = x @ w, the loop, metrics and checkpoints of BaseTrainer."""

    def __init__(self, job_config: Any, folder: Path) -> None:
        super().__init__(job_config)
        torch.manual_seed(0)
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.run_folder = folder
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.lr_schedulers = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.lr_schedulers.get_last_lr = lambda: 0.1  # type: ignore[method-assign]
        steps = job_config.training.steps
        self.metrics = MetricsProcessor(job_config.metrics, folder, 0, steps, 1, 1)
        self.checkpointer = CheckpointManager(
            dataloader=None,
            model_parts=[self.model],
            optimizers=None,
            lr_schedulers=None,
            states={"train_state": self},
            checkpoint_config=job_config.checkpoint,
            base_folder=folder,
        )
        self.install_callbacks()

    def data_iterator(self) -> Any:
        w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        while True:
            x = torch.randn(8, 4)
            yield x, x @ w

    def train_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.get_total_norm([self.model.weight.grad])
        self.optimizer.step()
        return loss.detach(), norm


def test_base_trainer_runs_a_model_that_is_not_a_language_model(tmp_path: Path) -> None:
    cfg = ConfigManager().from_dict(
        {
            "training": {"steps": 30},
            "metrics": {"log_freq": 10, "enable_plot": False, "enable_progress_bar": False},
        }
    )
    trainer = _Regression(cfg, tmp_path)
    seen: list[int] = []

    class Count(Callback):
        def on_log(self, trainer: BaseTrainer, step: int, record: dict[str, Any]) -> None:
            seen.append(step)

    trainer.add_callback(Count())
    losses = trainer.train()
    assert len(losses) == 30
    assert losses[-1] < 0.05 * losses[0]
    assert seen == [1, 10, 20, 30]
    with pytest.raises(NotImplementedError, match="must implement train_step"):
        BaseTrainer(cfg).train_step(None)
