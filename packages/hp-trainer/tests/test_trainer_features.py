"""Single-process trainer features: activation checkpointing, compile, SIGTERM, errors."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_trainer import ConfigManager, JobConfig, Trainer, load_documents
from hp_trainer.distributed.activation_checkpoint import apply_ac


def _config(folder: Path, steps: int = 3, **sections: dict[str, Any]) -> JobConfig:
    corpus = folder / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(load_documents("tiny_stories_synth")[:150]) + "\n")
    values: dict[str, dict[str, Any]] = {
        "job": {"dump_folder": str(folder)},
        "model": {"flavor": "tiny"},
        "training": {
            "local_batch_size": 2,
            "seq_len": 32,
            "steps": steps,
            "mixed_precision_param": "float32",
        },
        "metrics": {"enable_plot": False, "enable_progress_bar": False},
        "data": {"dataset": str(corpus)},
    }
    for name, table in sections.items():
        values.setdefault(name, {}).update(table)
    return ConfigManager().from_dict(values)


def _losses(cfg: JobConfig) -> list[float]:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_activation_checkpointing_keeps_the_numbers(tmp_path: Path) -> None:
    plain = _losses(_config(tmp_path, steps=2))
    for mode, sel, expected in [
        ("full", "2", ["CheckpointWrapper", "CheckpointWrapper"]),
        ("selective", "2", ["TransformerBlock", "CheckpointWrapper"]),
        ("selective", "op", ["CheckpointWrapper", "CheckpointWrapper"]),
    ]:
        ac = {"mode": mode, "selective_ac_option": sel}
        trainer = Trainer(_config(tmp_path, steps=2, activation_checkpoint=ac))
        assert [type(b).__name__ for b in trainer.model.layers.values()] == expected
        torch.testing.assert_close(trainer.train(), plain, rtol=1e-6, atol=1e-6)
        trainer.close()


def test_apply_ac_rejects_none_mode() -> None:
    from hp_trainer import ActivationCheckpointConfig, Decoder, DecoderArgs

    model = Decoder(DecoderArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, multiple_of=16))
    with pytest.raises(ValueError, match="mode = 'none'"):
        apply_ac(model, ActivationCheckpointConfig())


def test_compile_aot_eager_matches_eager(tmp_path: Path) -> None:
    plain = _losses(_config(tmp_path, steps=1))
    compiled = _losses(_config(tmp_path, steps=1, compile={"enable": True, "backend": "aot_eager"}))
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)


def test_deterministic_mode_repeats_exactly(tmp_path: Path) -> None:
    try:
        a = _losses(_config(tmp_path, steps=2, training={"deterministic": True}))
        b = _losses(_config(tmp_path, steps=2, training={"deterministic": True}))
    finally:
        torch.use_deterministic_algorithms(False)
    assert a == b


def test_sigterm_stops_cleanly_after_the_current_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=50, metrics={"log_freq": 1})
    trainer = Trainer(cfg)
    real_log = trainer.metrics.log

    def log_then_signal(step: int, *args: Any, **kwargs: Any) -> Any:
        record = real_log(step, *args, **kwargs)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    trainer.metrics.log = log_then_signal  # type: ignore[method-assign]
    previous = signal.getsignal(signal.SIGTERM)
    losses = trainer.train()
    trainer.close()
    assert len(losses) == 3
    assert signal.getsignal(signal.SIGTERM) == previous  # handler restored
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3


def test_unsupported_options_raise(tmp_path: Path) -> None:
    # PP works since 0.1.2; a degree the world cannot hold fails before any process group
    with pytest.raises(ValueError, match=r"dp_replicate\*cp\*tp\*pp = 2"):
        Trainer(_config(tmp_path, parallelism={"pipeline_parallel_degree": 2}))
    with pytest.raises(ValueError, match=r"create_seed_checkpoint = true needs"):
        Trainer(_config(tmp_path, checkpoint={"create_seed_checkpoint": True}))
    with pytest.raises(ValueError, match="world_size"):
        Trainer(_config(tmp_path, parallelism={"tensor_parallel_degree": 2}))
    with pytest.raises(ValueError, match="global_batch_size = 3"):
        Trainer(_config(tmp_path, training={"global_batch_size": 3}))
