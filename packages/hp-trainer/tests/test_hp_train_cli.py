"""``hp-train`` end to end: launcher, ranks, outputs (in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp_trainer import load_documents


@pytest.mark.slow
def test_hp_train_launches_ranks_and_writes_outputs(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(load_documents("tiny_stories_synth")[:200]) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [
        sys.executable, "-m", "hp_trainer.cli",
        "--config", "debug",
        "--model.flavor", "tiny",
        "--training.steps", "3",
        "--training.seq_len", "32",
        "--training.local_batch_size", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.tensor_parallel_degree", "2",
        "--metrics.log_freq", "1",
        "--data.dataset", str(corpus),
        "--job.dump_folder", str(tmp_path / "out"),
        "--job.run_name", "e2e",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "starting 2 local ranks" in out
    run = tmp_path / "out" / "e2e"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["mfu_percent"] is None for r in records)
    assert (run / "loss.png").stat().st_size > 1000
    assert json.loads((run / "config.json").read_text())["training"]["steps"] == 3
    assert "step     3  loss" in out
