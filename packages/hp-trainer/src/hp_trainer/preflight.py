"""Start-up checks that run once, before any worker process or process group exists.

Every rank would hit the same error on a bad config, a missing file or a missing optional
package; checking here reports it once, with what to change, instead of once per rank after
the launcher started them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from hp_trainer.config import JobConfig

__all__ = ["OptionalDependency", "PreflightReport", "missing_optional_dependencies", "preflight"]


@dataclass(frozen=True)
class OptionalDependency:
    """A package that one config option needs and hp-trainer does not install by default.

    Attributes:
        option: The ``section.field`` that needs it.
        module: The module imported.
        extra: The hp-trainer extra that installs it.
        required: Whether the run cannot go on without it (else the option is switched off
            with a note).

    See Also:
        ``importlib.util.find_spec``: how presence is checked (without importing).
    """

    option: str
    module: str
    extra: str
    required: bool

    @property
    def pip_command(self) -> str:
        """The command that installs the missing package."""
        return f"pip install 'hp-trainer[{self.extra}]'"


def missing_optional_dependencies(config: JobConfig) -> list[OptionalDependency]:
    """The optional packages that the chosen options need and this environment lacks.

    Args:
        config: The configuration.

    Returns:
        One entry per enabled option whose package is not importable.

    See Also:
        :titan:`torchtitan.tools.utils`: TorchTitan imports its optional packages lazily as well.
    """
    wanted: list[OptionalDependency] = []
    if config.metrics.enable_tensorboard:
        wanted.append(
            OptionalDependency("metrics.enable_tensorboard", "tensorboard", "tensorboard", True)
        )
    if config.metrics.enable_wandb:
        wanted.append(OptionalDependency("metrics.enable_wandb", "wandb", "wandb", True))
    if config.metrics.enable_plot:
        wanted.append(OptionalDependency("metrics.enable_plot", "matplotlib", "plot", False))
    if config.data.streaming:
        wanted.append(OptionalDependency("data.streaming", "datasets", "datasets", True))
    return [dep for dep in wanted if importlib.util.find_spec(dep.module) is None]


@dataclass(frozen=True)
class PreflightReport:
    """What ``preflight()`` found that does not stop the run.

    Attributes:
        notes: Lines to print once (an optional feature switched off, and why).
        overrides: ``--section.field value`` arguments to pass on to the ranks so that they do
            not try the switched-off features again.
    """

    notes: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()


def preflight(config: JobConfig, world_size: int) -> PreflightReport:
    """Check a job before starting it: fail on errors every rank would hit, note the rest.

    Args:
        config: The configuration.
        world_size: The number of ranks the job will have.

    Returns:
        Notes and overrides for features switched off because an optional package is missing.

    Raises:
        ValueError: For a model flavor, parallel layout, dataset or tokenizer that cannot work,
            naming the value and what is expected.
        ImportError: For an option that needs a missing package, naming the pip command.
        FileNotFoundError: For ``model.flavor = auto`` and a checkpoint without config.json, or
            a missing tokenizer.

    See Also:
        :titan:`torchtitan.train.main`: TorchTitan validates in each rank instead.
    """
    from hp_trainer.components.data.dataset import BUILTIN_DATASETS
    from hp_trainer.components.data.prepared import PreparedTokenDataset, is_prepared_corpus
    from hp_trainer.components.data.streaming import check_streaming_source
    from hp_trainer.components.hf_io.config import resolve_model_args
    from hp_trainer.components.tokenizer import build_tokenizer
    from hp_trainer.distributed.layout_validation import validate_parallel_layout
    from hp_trainer.protocols.model_spec import get_model_spec

    args = resolve_model_args(get_model_spec(config.model.name), config)
    validate_parallel_layout(config, world_size, args)
    dataset = config.data.dataset
    for option, value in (
        ("data.dataset", None if config.data.streaming else dataset),  # streamed: checked below
        ("validation.dataset", config.validation.dataset if config.validation.enable else None),
    ):
        if value is not None and value not in BUILTIN_DATASETS and not os.path.exists(value):
            raise ValueError(
                f"{option} = {value!r} is neither a built-in dataset "
                f"({', '.join(BUILTIN_DATASETS)}) nor an existing file or folder"
            )
    data = config.data
    tokenizer = build_tokenizer(
        data.tokenizer_path, bos_token=data.bos_token, eos_token=data.eos_token
    )
    vocab = getattr(args, "vocab_size", tokenizer.vocab_size)
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but model "
            f"{config.model.name}/{config.model.flavor} has vocab_size {vocab}"
        )
    if is_prepared_corpus(dataset):
        prepared = PreparedTokenDataset(dataset, config.training.seq_len)  # checks every shard
        if prepared.vocab_size > vocab:
            raise ValueError(
                f"the prepared corpus {dataset} was tokenized with {prepared.vocab_size} ids "
                f"but model {config.model.name}/{config.model.flavor} has vocab_size {vocab}"
            )
        prepared.close()
    notes: list[str] = []
    overrides: list[str] = []
    for dep in missing_optional_dependencies(config):
        if dep.required:
            raise ImportError(
                f"{dep.option} = true needs the '{dep.module}' package, which is not installed: "
                f"{dep.pip_command} (or set {dep.option} false)"
            )
        notes.append(
            f"{dep.option} is off for this run: it needs '{dep.module}' ({dep.pip_command})"
        )
        overrides += [f"--{dep.option}", "false"]
    if data.streaming:  # opens the stream: a missing file, field or record fails here, once
        check_streaming_source(dataset, data.jsonl_text_field)
    return PreflightReport(tuple(notes), tuple(overrides))
