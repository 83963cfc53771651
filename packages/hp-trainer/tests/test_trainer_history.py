"""Resumed runs keep their history; SIGTERM exit statuses; async saves hold pre-step weights."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import types
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import hp_dcp
from hp_dtensor.testing import load_test_module
from hp_trainer import ConfigManager, JobConfig, MetricsConfig, MetricsProcessor, Trainer
from hp_trainer.cli import EXIT_STOPPED_SAVED, EXIT_STOPPED_UNSAVED, _stop_status


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _config(folder: Path, run: str, steps: int, checkpoint: dict[str, Any]) -> JobConfig:
    corpus = _helpers().corpus(folder, 120)
    return ConfigManager().from_dict(
        {
            "job": {"run_name": run, "dump_folder": str(folder)},
            "model": {"flavor": "tiny"},
            "training": {
                "local_batch_size": 2,
                "seq_len": 32,
                "steps": steps,
                "seed": 0,
                "mixed_precision_param": "float32",
            },
            "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_progress_bar": False},
            "data": {"dataset": corpus},
            "checkpoint": checkpoint,
        }
    )


def _run(cfg: JobConfig, stop_after: int | None = None) -> Trainer:
    trainer = Trainer(cfg)
    if stop_after is not None:
        _helpers().stop_at(trainer, stop_after)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


_CKPT = {"enable": True, "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def test_resumed_run_appends_its_history_without_duplicates(tmp_path: Path) -> None:
    # a run that got to step 4 (checkpoints 2 and 4), then lost step-4: it resumes from step 2
    # while its files already hold steps 3-4, which are computed again
    first = _run(_config(tmp_path, "run", 4, _CKPT))
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-4")
    (tmp_path / "run" / "loss.png").unlink()
    resumed = _run(_config(tmp_path, "run", 4, _CKPT))
    assert resumed.checkpointer.loaded_step == 2
    assert resumed.losses == first.losses[2:]  # the same numbers as the uninterrupted run

    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")[:-1]
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == first.losses  # the whole run, in order, once
    curve = (tmp_path / "run" / "loss_curve.tsv").read_text().splitlines()
    assert [float(line.split("\t")[1]) for line in curve] == first.losses
    # the plot of the resumed process shows the whole run, not only steps 3-4
    assert resumed.metrics.loss_curve == list(enumerate(first.losses, start=1))
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000


def test_a_torn_last_line_is_dropped_on_resume(tmp_path: Path) -> None:
    proc = MetricsProcessor(MetricsConfig(enable_plot=True), tmp_path, 0, 10, 1)
    proc.jsonl_path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"ste')
    proc.loss_curve_path.write_text("1\t3.0\n2\t2.0\n3\t1.")
    proc.start(2)
    proc.observe_loss(3, 1.5)
    proc.close()
    assert proc.loss_curve == [(1, 3.0), (2, 2.0), (3, 1.5)]
    assert proc.jsonl_path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n'


def test_tensorboard_continues_with_later_events_purged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []

    class RecordingWriter:  # stands in for tensorboard's SummaryWriter (not a dev dependency)
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

        def add_scalar(self, *args: Any) -> None: ...

        def close(self) -> None: ...

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = RecordingWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    config = MetricsConfig(enable_tensorboard=True, enable_plot=False)
    MetricsProcessor(config, tmp_path / "a", 0, 10, 1).start(0)
    MetricsProcessor(config, tmp_path / "b", 0, 10, 1).start(7)
    assert made == [
        {"log_dir": str(tmp_path / "a" / "tb")},
        {"log_dir": str(tmp_path / "b" / "tb"), "purge_step": 8},
    ]


def test_sigterm_stop_status_saved_or_unsaved(tmp_path: Path) -> None:
    saved = _run(_config(tmp_path, "saved", 4, _CKPT), stop_after=1)
    assert saved.stop_status == "saved"
    assert (tmp_path / "saved" / "checkpoint" / "step-1").is_dir()
    unsaved = _run(_config(tmp_path, "unsaved", 4, {}), stop_after=1)
    assert unsaved.stop_status == "unsaved"

    # what hp-train's launcher reads back from the ranks (its exit status)
    assert json.loads(saved.stop_record_path.read_text()) == {
        "step": 1,
        "status": "saved",
        "checkpoint": str(tmp_path / "saved" / "checkpoint" / "step-1"),
    }
    assert _stop_status(saved.run_folder, 0.0) == EXIT_STOPPED_SAVED == 75
    assert _stop_status(unsaved.run_folder, 0.0) == EXIT_STOPPED_UNSAVED == 143
    # a record older than this launch is not this launch's
    assert _stop_status(saved.run_folder, saved.stop_record_path.stat().st_mtime + 1) is None
    # a resumed run removes the record of the stop it resumes from
    again = _run(_config(tmp_path, "saved", 2, _CKPT))
    assert again.stop_status is None
    assert not again.stop_record_path.exists()
    assert _stop_status(again.run_folder, 0.0) is None


class _SlowStager(DefaultStager):
    """Background staging that copies only once the training thread moved on."""

    def __init__(self) -> None:
        super().__init__(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        self.release = threading.Event()

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        future: Future[Any] = Future()

        def run() -> None:
            self.release.wait(timeout=2.0)  # long enough for a step to run if nobody waits
            try:
                future.set_result(super(_SlowStager, self).stage(state_dict, **kwargs).result())
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return future


def _model_weights(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    hp_dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def test_async_checkpoint_holds_the_pre_step_weights(tmp_path: Path) -> None:
    ckpt = {"enable": True, "interval": 2, "keep_latest_k": 0, "async_mode": "async"}
    trainer = Trainer(_config(tmp_path, "async", 3, ckpt))
    stager = _SlowStager()
    trainer.checkpointer._stager = stager
    after_step: dict[int, dict[str, torch.Tensor]] = {}
    save = trainer.checkpointer.save

    def save_and_record(step: int, *args: Any, **kwargs: Any) -> bool:
        after_step[step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return save(step, *args, **kwargs)

    trainer.checkpointer.save = save_and_record  # type: ignore[method-assign]
    wait = trainer.checkpointer.maybe_wait_for_staging

    def release_then_wait() -> None:  # the trainer waits here before the optimizer step
        stager.release.set()
        wait()

    trainer.checkpointer.maybe_wait_for_staging = release_then_wait  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
        stager.close()
    saved = _model_weights(tmp_path / "async" / "checkpoint" / "step-2", after_step[2])
    assert saved.keys() == after_step[2].keys()
    for name, value in after_step[2].items():
        assert torch.equal(saved[name], value), name
    # and the step after it did change the weights (the check above could not pass by chance)
    assert not all(torch.equal(after_step[3][k], v) for k, v in after_step[2].items())
