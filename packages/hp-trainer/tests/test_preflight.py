"""Start-up checks: a missing optional package is reported once, before any rank starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from hp_trainer import ConfigManager
from hp_trainer.cli import main
from hp_trainer.preflight import PreflightReport, missing_optional_dependencies, preflight


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in modules else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_tokenizers_is_a_default_dependency() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert any(d.startswith("tokenizers") for d in deps)


def test_missing_tensorboard_fails_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "tensorboard")
    # the debug config wants 4 ranks: an error here means none was started
    assert main(["--config", "debug", "--metrics.enable_tensorboard"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert "metrics.enable_tensorboard = true needs the 'tensorboard' package" in err
    assert "pip install 'hp-trainer[tensorboard]'" in err


def test_missing_matplotlib_switches_the_plot_off_with_one_note(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _hide(monkeypatch, "matplotlib")
    cfg = ConfigManager().parse_args(["--config", "debug"])
    assert [d.module for d in missing_optional_dependencies(cfg)] == ["matplotlib"]
    report = preflight(cfg, 4)
    assert report.overrides == ("--metrics.enable_plot", "false")
    (note,) = report.notes
    assert "metrics.enable_plot" in note
    assert "pip install 'hp-trainer[plot]'" in note
    # the ranks receive the override, so they find nothing left to report
    again = ConfigManager().parse_args(["--config", "debug", *report.overrides])
    assert preflight(again, 4).notes == ()


def test_present_packages_give_no_notes() -> None:
    cfg = ConfigManager().parse_args(["--config", "debug", "--metrics.enable_plot", "false"])
    assert preflight(cfg, 4) == PreflightReport()
