"""Weights & Biases logging (optional extra, off by default), offline: files, no network."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hp_trainer import ConfigManager, MetricsConfig, MetricsProcessor
from hp_trainer.preflight import missing_optional_dependencies


def test_wandb_is_off_by_default_and_a_declared_extra() -> None:
    cfg = ConfigManager().parse_args([])
    assert cfg.metrics.enable_wandb is False
    wanted = ConfigManager().parse_args(["--metrics.enable_wandb"])
    found = {d.module for d in missing_optional_dependencies(wanted)}
    assert ("wandb" in found) == (__import__("importlib").util.find_spec("wandb") is None)


def test_offline_run_writes_its_files_and_resumes_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "hp-trainer-test")
    # wandb's caches, settings and its service's debug logs default to the home folder
    for var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "home" / "data"))
    config = MetricsConfig(enable_wandb=True, enable_plot=False, log_freq=1)
    proc = MetricsProcessor(config, tmp_path, 0, 4, 1000, stream=io.StringIO())
    proc.start(0)
    for step in (1, 2):
        proc.add_tokens(64)
        proc.log(step, 3.0 - step, 0.5, 1e-3)
    proc.log_validation(2, 2.5, 12.2)
    proc.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert runs[0].name.endswith(run_id)
    assert any(runs[0].glob("*.wandb"))  # the offline run's event log, to `wandb sync` later
    # the resumed run asks W&B to continue the id the folder keeps (checked at the call: in one
    # loaded CI run wandb's own offline folder for it carried another id, which is wandb's doing)
    wandb = pytest.importorskip("wandb")
    calls: list[dict[str, object]] = []
    real_init = wandb.init

    def recording_init(**kwargs: object) -> object:
        calls.append(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", recording_init)
    resumed = MetricsProcessor(config, tmp_path, 0, 4, 1000, stream=io.StringIO())
    resumed.start(2)
    resumed.log(3, 0.5, 0.5, 1e-3)
    resumed.close()
    assert [(c["id"], c["resume"], c["dir"]) for c in calls] == [(run_id, "allow", str(tmp_path))]
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
