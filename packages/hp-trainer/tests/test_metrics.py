"""MetricsProcessor outputs and the messages for missing optional dependencies."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from hp_trainer import HuggingFaceTokenizer, MetricsConfig, MetricsProcessor, get_peak_flops


def _processor(tmp_path: Path, **cfg: object) -> tuple[MetricsProcessor, io.StringIO]:
    out = io.StringIO()
    config = MetricsConfig(log_freq=2, **cfg)  # type: ignore[arg-type]
    return MetricsProcessor(config, tmp_path, 0, 4, 1000, stream=out), out


def test_console_jsonl_and_plot(tmp_path: Path) -> None:
    proc, out = _processor(tmp_path)
    for step in range(1, 5):
        proc.add_tokens(64)
        proc.observe_loss(step, 5.0 - step)
        if proc.should_log(step):
            proc.log(step, 5.0 - step, 0.5, 1e-3)
    assert proc.close() == tmp_path / "loss.png"
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # steps 1, 2, 4
    assert "mfu n/a" in lines[0]
    assert "100.0%" in lines[-1]  # progress bar
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4]
    assert records[0]["tokens_per_second"] > 0
    assert records[0]["mfu_percent"] is None
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_configured_peak_gives_mfu(tmp_path: Path) -> None:
    proc, _ = _processor(tmp_path, peak_flops=1e9, enable_plot=False)
    proc.add_tokens(100)
    rec = proc.log(1, 1.0, 1.0, 1e-3)
    assert rec["mfu_percent"] == pytest.approx(100 * rec["tflops"] * 1e12 / 1e9)
    assert get_peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12)
    assert get_peak_flops("cpu") is None


def test_missing_matplotlib_skips_the_plot_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    proc, _ = _processor(tmp_path)
    proc.observe_loss(1, 1.0)
    assert proc.close() is None
    assert "hp-trainer[plot]" in caplog.text


def test_tensorboard_writes_events_or_names_the_extra(tmp_path: Path) -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"hp-trainer\[tensorboard\]"):
            _processor(tmp_path, enable_tensorboard=True)
        return
    proc, _ = _processor(tmp_path, enable_tensorboard=True)
    proc.log(1, 1.0, 1.0, 1e-3)
    proc.close()
    assert any((tmp_path / "tb").iterdir())


def test_missing_tokenizers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"hp-trainer\[tokenizers\]"):
        HuggingFaceTokenizer()
