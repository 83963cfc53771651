"""Config parsing: files, overrides, errors and --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hp_trainer import ConfigManager, JobConfig, TrainingConfig, builtin_config_names, parse_args
from hp_trainer.cli import main, nproc_for


def test_defaults_and_overrides_both_syntaxes() -> None:
    cfg = parse_args(
        [
            "--training.steps",
            "7",
            "--optimizer.lr=0.01",
            "--parallelism.tensor-parallel-degree",
            "2",
        ]
    )
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == pytest.approx(0.01)
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.training.seq_len == JobConfig().training.seq_len  # untouched default


def test_bare_bool_flag_and_explicit_false() -> None:
    cfg = parse_args(["--compile.enable", "--metrics.enable_plot", "false"])
    assert cfg.compile.enable is True
    assert cfg.metrics.enable_plot is False


def test_optional_none_and_literal() -> None:
    cfg = parse_args(["--training.seed", "none", "--lr_scheduler.decay_type", "wsd"])
    assert cfg.training.seed is None
    assert cfg.lr_scheduler.decay_type == "wsd"


def test_shipped_debug_config_and_cli_precedence() -> None:
    assert "debug" in builtin_config_names()
    cfg = parse_args(["--config", "debug", "--training.steps", "3"])
    assert cfg.model.flavor == "debugmodel"
    assert cfg.parallelism.data_parallel_shard_degree == 2
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.training.steps == 3  # command line beats the file
    assert nproc_for(cfg) == 4


def test_every_shipped_config_loads() -> None:
    for name in builtin_config_names():
        cfg = parse_args(["--config", name])
        assert cfg.job.config_file is not None


def test_toml_and_yaml_files(tmp_path: Path) -> None:
    toml = tmp_path / "a.toml"
    toml.write_text('[training]\nsteps = 11\n[model]\nname = "qwen3"\n')
    yaml_file = tmp_path / "b.yaml"
    yaml_file.write_text("training:\n  steps: 12\nmodel:\n  flavor: tiny\n")
    assert parse_args(["--job.config_file", str(toml)]).training.steps == 11
    assert parse_args(["--job.config_file", str(toml)]).model.name == "qwen3"
    cfg = parse_args(["--config", str(yaml_file)])
    assert (cfg.training.steps, cfg.model.flavor) == (12, "tiny")


def test_unknown_field_is_named_with_a_suggestion() -> None:
    with pytest.raises(ValueError, match=r"training\.stepz.*did you mean training\.steps"):
        parse_args(["--training.stepz", "3"])
    with pytest.raises(ValueError, match="unknown config section 'trainig'"):
        parse_args(["--trainig.steps", "3"])


def test_bad_values_name_field_value_and_allowed() -> None:
    with pytest.raises(ValueError, match=r"training\.steps = 'abc'.*integer"):
        parse_args(["--training.steps", "abc"])
    with pytest.raises(ValueError, match=r"fsdp_reshard_after_forward = 'sometimes'.*'always'"):
        parse_args(["--parallelism.fsdp_reshard_after_forward", "sometimes"])
    with pytest.raises(ValueError, match=r"training\.steps = 0.*>= 1"):
        parse_args(["--training.steps", "0"])
    with pytest.raises(ValueError, match=r"optimizer\.beta2 = 1\.5"):
        parse_args(["--optimizer.beta2", "1.5"])
    with pytest.raises(ValueError, match=r"selective_ac_option = 'x'"):
        parse_args(["--activation_checkpoint.selective_ac_option", "x"])
    with pytest.raises(ValueError, match="needs a value"):
        parse_args(["--training.steps"])
    with pytest.raises(ValueError, match="shipped configs"):
        parse_args(["--config", "no_such_config"])


def test_sections_are_keyword_only_and_validate_in_code() -> None:
    with pytest.raises(TypeError):
        TrainingConfig(10)  # type: ignore[misc]
    with pytest.raises(ValueError, match="mixed_precision_param = 'fp8'"):
        TrainingConfig(mixed_precision_param="fp8")  # type: ignore[arg-type]


def test_help_lists_every_field_with_default_and_doc(capsys: pytest.CaptureFixture[str]) -> None:
    text = ConfigManager().help_text()
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(
            section.type
            if isinstance(section.type, type)
            else type(getattr(JobConfig(), section.name))
        ):
            assert f"--{section.name}.{f.name} " in text, f.name
    assert "--training.steps int (default: 10)" in text
    assert "Number of optimizer steps." in text
    # every field line is followed by a non-empty docstring line
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  --") and "(default:" in line:
            assert lines[i + 1].startswith("      "), line
            assert lines[i + 1].strip(), line
    assert main(["--help"]) == 0
    assert "--parallelism.tensor_parallel_degree" in capsys.readouterr().out


def test_parse_args_help_exits_zero() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0


def test_cli_reports_config_errors_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--training.steps", "-3"]) == 2
    assert "training.steps = -3" in capsys.readouterr().err
    # checked before any rank starts: model flavor, degrees against --nproc, dataset
    assert main(["--config", "debug", "--model.flavor", "huge"]) == 2
    assert "has no flavor 'huge'" in capsys.readouterr().err
    assert main(["--config", "debug", "--nproc", "6"]) == 2
    assert "!= world_size(6)" in capsys.readouterr().err
    assert main(["--config", "debug", "--data.dataset", "/no/such/file.txt"]) == 2
    assert "data.dataset = '/no/such/file.txt'" in capsys.readouterr().err
