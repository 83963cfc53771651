"""Model converters: in-place rewrites of the model applied before parallelisation.

A converter (Float8 linears, MXFP8 linears, LoRA adapters) is a small class built from the job
configuration and the parallel dimensions; :meth:`ModelConverter.convert` rewrites the freshly
built model (before tensor parallel, activation checkpointing, compile and FSDP), and
:meth:`ModelConverter.post_optimizer_hook` runs after every optimizer step. ``--model.converters``
lists the converters by name and they are applied in that order (TorchTitan's semantics).

Built-in names are resolved lazily (``"module:Class"`` strings): the converter's module and its
optional dependencies (torchao, peft) are imported only when a job asks for it.
:func:`register_model_converter` adds a converter class under a new name.

See Also:
    :titan:`torchtitan.protocols.model_converter`: TorchTitan's protocol, which this follows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "ModelConverter",
    "ModelConvertersContainer",
    "build_model_converters",
    "model_converter_names",
    "register_model_converter",
]

# name -> "module:Class", imported on first use (no optional dependency at import time)
_BUILTIN_CONVERTERS: dict[str, str] = {
    "float8": "hp_trainer.components.converters.float8:Float8Converter",
    "mx": "hp_trainer.components.converters.mx:MXConverter",
    "lora": "hp_trainer.components.converters.lora:LoRAConverter",
}
# converters registered at run time (class by name); a registered name shadows a built-in
_REGISTERED: dict[str, type[Any]] = {}


@runtime_checkable
class ModelConverter(Protocol):
    """What a model converter provides.

    A converter is built once per job, with ``(job_config, parallel_dims)``, before the model is
    parallelised. :meth:`convert` rewrites the model in place; :meth:`post_optimizer_hook` runs
    after each optimizer step (on every model part under pipeline parallel).

    See Also:
        :titan:`torchtitan.protocols.model_converter.ModelConverter`.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None: ...

    def convert(self, model: nn.Module) -> None:
        """Rewrite ``model`` in place (called once, before parallelisation).

        Args:
            model: The whole model as built by its model class.
        """
        ...

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Run after each optimizer step.

        Args:
            model: The model, or this rank's model parts under pipeline parallel.
        """
        ...


def register_model_converter(cls: type[Any], name: str) -> None:
    """Register a converter class under ``name`` (usable in ``--model.converters``).

    Register before the configuration is parsed: the parser refuses names it does not know.

    Args:
        cls: A class following :class:`ModelConverter` (``convert`` and
            ``post_optimizer_hook`` methods, built from ``(job_config, parallel_dims)``).
        name: The name jobs use; a built-in name (``float8``, ``mx``, ``lora``) may not be
            taken, nor a name registered before.

    Raises:
        TypeError: When ``cls`` is not a class or lacks ``convert``/``post_optimizer_hook``.
        ValueError: When ``name`` is empty, holds a comma, or is already taken.

    See Also:
        :titan:`torchtitan.protocols.model_converter.register_model_converter`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_model_converter expects a class, got {cls!r}")
    missing = [m for m in ("convert", "post_optimizer_hook") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"register_model_converter: {cls.__qualname__} lacks {', '.join(missing)}; a model "
            "converter has convert(model) and post_optimizer_hook(model)"
        )
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise ValueError(
            f"register_model_converter: name {name!r} must be a non-empty string without "
            "commas or surrounding spaces"
        )
    if name in _BUILTIN_CONVERTERS or name in _REGISTERED:
        raise ValueError(
            f"register_model_converter: the name {name!r} is already taken "
            f"(known converters: {', '.join(model_converter_names())})"
        )
    _REGISTERED[name] = cls


def model_converter_names() -> list[str]:
    """The names ``--model.converters`` accepts: the built-ins, then the registered ones.

    Returns:
        Converter names.
    """
    return [*_BUILTIN_CONVERTERS, *(n for n in _REGISTERED if n not in _BUILTIN_CONVERTERS)]


def check_converter_names(names: list[str]) -> None:
    """Refuse unknown or repeated converter names (called when the configuration is parsed).

    Args:
        names: ``model.converters``.

    Raises:
        ValueError: Naming the unknown or repeated entry and the known names.
    """
    known = model_converter_names()
    seen: set[str] = set()
    for name in names:
        if name not in known:
            raise ValueError(
                f"invalid config value model.converters = {names!r}: unknown converter "
                f"{name!r}; known converters: {', '.join(known)}"
            )
        if name in seen:
            raise ValueError(
                f"invalid config value model.converters = {names!r}: {name!r} is listed twice "
                "(each converter applies once)"
            )
        seen.add(name)


def _converter_class(name: str) -> type[Any]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN_CONVERTERS:
        raise ValueError(
            f"unknown model converter {name!r}; known converters: "
            f"{', '.join(model_converter_names())}"
        )
    module_name, _, attr = _BUILTIN_CONVERTERS[name].partition(":")
    module = importlib.import_module(module_name)
    cls: type[Any] = getattr(module, attr)
    return cls


class ModelConvertersContainer:
    """The converters of a job, applied in ``model.converters`` order.

    Args:
        job_config: The configuration (``model.converters`` names the converters).
        parallel_dims: The job's parallel dimensions.

    Raises:
        ValueError: For an unknown converter name (the parser refuses it earlier).

    See Also:
        :titan:`torchtitan.protocols.model_converter.ModelConvertersContainer`.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        names = list(job_config.model.converters)
        check_converter_names(names)
        self.names = names
        """The converter names, in application order."""
        self.converters: list[Any] = [
            _converter_class(name)(job_config, parallel_dims) for name in names
        ]
        """The converter instances, in application order."""

    def convert(self, model: nn.Module) -> None:
        """Apply every converter's ``convert`` in order.

        Args:
            model: The whole model, before parallelisation.
        """
        for converter in self.converters:
            converter.convert(model)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Call every converter's ``post_optimizer_hook`` in order.

        Args:
            model: The model or this rank's model parts.
        """
        for converter in self.converters:
            converter.post_optimizer_hook(model)

    # -- optional converter methods (meta init, checkpointing) ----------------------------------

    def init_weights(self, part: nn.Module) -> None:
        """Initialise what the converters added, after a meta-built part got real storage.

        ``model.init_device = "meta"``: the model's own ``init_weights`` knows nothing of the
        converters' modules; each converter with an ``init_weights(part)`` method is called.

        Args:
            part: A model part after ``to_empty`` and its own ``init_weights``.
        """
        for conv in self.converters:
            if hasattr(conv, "init_weights"):
                conv.init_weights(part)

    def checkpoint_states(self) -> dict[str, Any]:
        """The converters that carry checkpoint state (``state_dict``/``load_state_dict``).

        Returns:
            ``{name: converter}``, for the checkpoint manager's ``states`` (LoRA records its
            rank and alpha there and refuses a checkpoint saved with others).
        """
        return {
            name: conv
            for name, conv in zip(self.names, self.converters, strict=True)
            if hasattr(conv, "state_dict") and hasattr(conv, "load_state_dict")
        }

    def model_key_filter(self) -> Callable[[str], bool] | None:
        """The model keys checkpoints hold, from the converters' ``model_key_filter()``.

        Returns:
            A predicate on state-dict keys (LoRA with ``save_adapter_only``: the adapters), or
            None when every key is saved.
        """
        filters = [
            f for conv in self.converters if hasattr(conv, "model_key_filter")
            if (f := conv.model_key_filter()) is not None
        ]  # fmt: skip
        if not filters:
            return None
        return lambda key: any(f(key) for f in filters)

    def hf_export_transform(
        self, sd_adapter: Any
    ) -> Callable[[dict[str, torch.Tensor], Path], dict[str, torch.Tensor]] | None:
        """What the HF export applies to the full state first (the converters' ``hf_export``).

        Args:
            sd_adapter: The model's HF state-dict adapter.

        Returns:
            ``fn(full_state, export_path) -> state`` chaining the converters in order (LoRA
            merges its adapters and writes the PEFT adapter), or None.
        """
        hooks = [conv for conv in self.converters if hasattr(conv, "hf_export")]
        if not hooks or sd_adapter is None:
            return None

        def transform(full: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
            for conv in hooks:
                full = conv.hf_export(full, path, sd_adapter)
            return full

        return transform

    def __len__(self) -> int:
        return len(self.converters)

    def __iter__(self) -> Any:
        return iter(self.converters)


def build_model_converters(
    job_config: JobConfig, parallel_dims: ParallelDims
) -> ModelConvertersContainer:
    """Build the converters ``job_config.model.converters`` names, in that order.

    Args:
        job_config: The configuration.
        parallel_dims: The job's parallel dimensions.

    Returns:
        The container (empty when no converter is configured: its hooks do nothing).

    Raises:
        ValueError: For an unknown converter name.

    See Also:
        :titan:`torchtitan.protocols.model_converter.build_model_converters`.
    """
    return ModelConvertersContainer(job_config, parallel_dims)
