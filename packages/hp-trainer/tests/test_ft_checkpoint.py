"""Fault tolerance with checkpoints: a full restart from disk resumes exactly (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchft")

from torchft.coordination import LighthouseServer

from hp_trainer import Trainer
from hp_trainer.config import ConfigManager


def _run(tmp: Path, run: str, steps: int, extra: list[str]) -> Trainer:
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    lighthouse = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    args = [
        "--config", "debug_ft", "--training.steps", str(steps),
        "--fault_tolerance.group_size", "1", "--fault_tolerance.lighthouse", lighthouse,
        "--fault_tolerance.trace", "true",
        "--metrics.log_freq", "1", "--metrics.enable_plot", "false",
        "--job.dump_folder", str(tmp), "--job.run_name", run, *extra,
    ]  # fmt: skip
    cfg = ConfigManager().parse_args(args)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
        server.shutdown()
    return trainer


def test_full_restart_from_disk_resumes_exactly(tmp_path: Path) -> None:
    full = _run(tmp_path, "full", 6, [])
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    ckpt += ["--checkpoint.last_save_model_only", "false"]  # step-4 is the last of run 1
    first = _run(tmp_path, "part", 4, ckpt)
    second = _run(tmp_path, "part", 6, ckpt)  # every group (here one) restarts from disk
    assert first.losses == full.losses[:4]
    assert second.checkpointer.loaded_step == 4
    assert second.losses == full.losses[4:]  # bitwise: same data position, same state
    assert second.ft.manager.current_step() == 6  # the manager's step came back from disk
    assert second.ft.param_digest() == full.ft.param_digest()


def test_no_commit_below_min_replica_size(tmp_path: Path) -> None:
    """One group of a job that needs two: the step runs but is never committed."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    lighthouse = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    args = [
        "--config", "debug_ft", "--training.steps", "3",
        "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2",
        "--fault_tolerance.lighthouse", lighthouse,
        "--job.dump_folder", str(tmp_path), "--job.run_name", "alone",
    ]  # fmt: skip
    trainer = Trainer(ConfigManager().parse_args(args))
    try:
        before = trainer.ft.param_digest()
        batches = trainer.data_iterator()
        for _ in range(2):
            assert trainer._run_step(next(batches)) is False  # not committed: nothing read
            assert trainer.step == 0
            assert trainer.ft.manager.current_step() == 0
            assert trainer.ft.num_replicas == 1  # it did run, with one participant
        assert trainer.ft.param_digest() == before  # the optimizer never stepped
        assert all(not o.state for o in trainer.optimizers)
        assert trainer.dataloader.samples_consumed == 0  # the samples are read again
        assert trainer.lr_schedulers.schedulers[0].last_epoch == 0
    finally:
        trainer.close()
        server.shutdown()
