"""--profiling.*: Chrome traces for a window of steps; memory snapshots noted as unavailable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hp_trainer import ConfigManager, Trainer, load_documents
from hp_trainer.components.profiling import MEMORY_SNAPSHOT_UNAVAILABLE


def test_profiler_writes_chrome_traces_of_the_window(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "c.txt").write_text("\n".join(load_documents("tiny_stories_synth")[:80]) + "\n")
    cfg = ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(tmp_path)},
            "model": {"flavor": "tiny"},
            "training": {"local_batch_size": 2, "seq_len": 32, "steps": 4,
                         "mixed_precision_param": "float32"},
            "metrics": {"enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(tmp_path / "c.txt")},
            "profiling": {"enable_profiling": True, "profile_freq": 2, "profiler_warmup": 1,
                          "enable_memory_snapshot": True},
        }
    )  # fmt: skip
    trainer = Trainer(cfg)
    with caplog.at_level("WARNING", logger="hp_trainer"):
        try:
            trainer.train()
        finally:
            trainer.close()
    assert trainer.profiler is not None
    traces = sorted(p.relative_to(tmp_path / "run") for p in trainer.profiler.traces)
    # steps 1-2 and 3-4: one warms up, one is traced
    assert [str(p) for p in traces] == [
        "profile_traces/iteration_2/rank0_trace.json",
        "profile_traces/iteration_4/rank0_trace.json",
    ]
    events = json.loads((tmp_path / "run" / traces[0]).read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the step's matmuls
    # CPU: no allocator history; one clear note, nothing written
    assert trainer.profiler.note == MEMORY_SNAPSHOT_UNAVAILABLE.format(device="cpu")
    assert trainer.profiler.note in caplog.text
    assert not (tmp_path / "run" / "memory_snapshot").exists()


def test_profiling_window_is_checked() -> None:
    with pytest.raises(ValueError, match=r"profiling.profile_freq = 2: expected >= "):
        ConfigManager().parse_args(["--profiling.profile_freq", "2"])
