"""Parse-time refusals that model families register (``ModelSpec.job_check``)."""

from __future__ import annotations

import pytest

from hp_trainer.config import ConfigManager


@pytest.mark.parametrize(
    ("model", "flag", "message"),
    [
        ("qwen3_5", "--compile.enable", r"compile\.enable = True.*Gated DeltaNet"),
        ("gpt_oss", "--moe.fused", r"moe\.fused = True.*no expert biases"),
    ],
)
def test_family_refuses_an_option_it_cannot_train_with(model: str, flag: str, message: str) -> None:
    args = ["--model.name", model, "--model.flavor", "tiny"]
    ConfigManager().parse_args(args)  # the family itself parses
    with pytest.raises(ValueError, match=message):
        ConfigManager().parse_args([*args, flag, "true"])
