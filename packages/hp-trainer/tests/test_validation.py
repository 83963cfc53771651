"""The validation loop: loss and perplexity against hand computations, in every output."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_trainer import (
    ConfigManager,
    HuggingFaceTokenizer,
    TokenizedDataset,
    Trainer,
    load_documents,
)
from hp_trainer.cli import main


def _config(folder: Path, **validation: Any) -> Any:
    docs = load_documents("tiny_stories_synth")
    (folder / "train.txt").write_text("\n".join(docs[:150]) + "\n")
    (folder / "valid.txt").write_text("\n".join(docs[-60:]) + "\n")
    return ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(folder)},
            "model": {"flavor": "tiny"},
            "training": {"local_batch_size": 2, "seq_len": 32, "steps": 4, "seed": 0,
                         "mixed_precision_param": "float32"},
            "metrics": {"log_freq": 1, "enable_progress_bar": False},
            "data": {"dataset": str(folder / "train.txt")},
            "validation": {"enable": True, "dataset": str(folder / "valid.txt"),
                           "local_batch_size": 3, **validation},
        }
    )  # fmt: skip


def test_validation_loss_equals_hand_computations(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, steps=2))
    try:
        assert trainer.validator is not None
        # a model whose logits are all zero predicts uniformly: loss ln(V), perplexity V
        with torch.no_grad():
            trainer.model.lm_head.weight.zero_()
        loss, perplexity = trainer.validator.validate(trainer.model)
        assert loss == pytest.approx(math.log(2048), rel=1e-7)  # ln V in float32
        assert perplexity == pytest.approx(2048, rel=1e-6)
        # a trained-from-init model: the mean cross entropy of the first 2 batches of 3 samples
        # of the file in order, computed here from plain forwards
        torch.manual_seed(1)
        trainer.model.init_weights()
        loss, perplexity = trainer.validator.validate(trainer.model)
        data = TokenizedDataset(
            load_documents(str(tmp_path / "valid.txt")), HuggingFaceTokenizer(), 32
        )
        inputs = torch.stack([data.sample(i)[0] for i in range(6)])
        labels = torch.stack([data.sample(i)[1] for i in range(6)])
        with torch.no_grad():
            expected = F.cross_entropy(trainer.model(inputs).flatten(0, 1), labels.flatten())
        assert loss == pytest.approx(float(expected), rel=1e-6)  # float32 log-softmax
        assert perplexity == pytest.approx(math.exp(float(expected)), rel=1e-6)
        assert trainer.model.training  # back in training mode
    finally:
        trainer.close()


def test_validation_during_training_reaches_every_output(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, freq=3))  # after steps 3 and 4 (the last)
    try:
        trainer.train()
    finally:
        trainer.close()
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in records if "validation_loss" in r]
    assert [r["step"] for r in validated] == [3, 4]
    assert all(r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]))
               for r in validated)  # fmt: skip
    assert trainer.validator is not None
    assert trainer.validator.num_batches == len(trainer.validator.dataset) // 3
    assert [s for s, _ in trainer.metrics.validation_curve] == [3, 4]
    assert (run / "loss.png").stat().st_size > 1000


def test_validation_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"validation.dataset = ''"):
        ConfigManager().parse_args(["--validation.enable"])
    with pytest.raises(ValueError, match=r"validation.steps = 0"):
        ConfigManager().parse_args(["--validation.steps", "0"])
    args = ["--validation.enable", "--validation.dataset", str(tmp_path / "none.txt")]
    assert main(args) == 2
    assert f"validation.dataset = '{tmp_path / 'none.txt'}'" in capsys.readouterr().err
