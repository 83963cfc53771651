"""``ModelSpec`` and the model registry.

The built-in families (:data:`BUILTIN_MODELS`) register themselves when their package under
``hp_trainer/models/`` is imported; the lookups below import them on first use, by name, so this
module depends on no model and no model depends on a lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims
    from hp_trainer.protocols.sharding import ShardingConfig

__all__ = [
    "BUILTIN_MODELS",
    "ModelSpec",
    "ParallelizeFn",
    "get_model_spec",
    "list_model_specs",
    "register_model_spec",
    "register_spec",
]

BUILTIN_MODELS = (
    "llama3",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v32",
    "llama4",
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
)
"""The families shipped in ``hp_trainer/models/<name>/``."""

ParallelizeFn = Callable[[nn.Module, "ParallelDims", "JobConfig"], nn.Module]


@dataclass
class ModelSpec:
    """Everything the trainer needs to know about a model family.

    Args:
        name: Registry name (``--model.name``).
        flavors: Flavor name -> model arguments (``--model.flavor``).
        model_cls: Class built as ``model_cls(args)``; it provides ``init_weights()`` and
            ``num_flops_per_token(seq_len)``.
        parallelize_fn: ``fn(model, parallel_dims, job_config) -> model`` applying TP, AC,
            compile and FSDP in that order.
        pipelining_fn: Pipeline splitter ``fn(model, parallel_dims, job_config, device,
            parallelize_fn, loss_fn) -> PipelineParts`` (e.g.
            ``hp_trainer.distributed.pipeline.pipeline_decoder``; None: the model cannot
            be pipelined, which the config check reports up front).
        state_dict_adapter: HF <-> native state-dict adapter class (None: none).
        args_from_hf_config: Keyword-style extension: ``fn(config, source) -> model args``
            building this family's arguments from an HF ``config.json`` (``--model.flavor
            auto``; None: not supported).
        sharding: Keyword-style extension: the family's declarative sharding table (TP, EP
            and CP sections), the one its parallelize function gives to
            :func:`hp_trainer.apply_sharding`; a ``cp`` section declares
            the context-parallel path (None: no table).
        context_parallel: Keyword-style extension: True when a family without a ``cp``
            section in its table still has a context-parallel path (SDPA attention; its
            parallelize function applies the CP placements itself).
        job_check: Keyword-style extension: ``fn(job_config) -> (section, field, value,
            expected) or None``, the family's own refusals, run when a job naming it is parsed
            (e.g. DeepSeek-V3.2's ``[dsa]`` options, Qwen3.5 with ``compile``).
        layout_check: Keyword-style extension: ``fn(parallel_dims, model_args) -> reason or
            None``, the family's own layout refusals, run by
            ``validate_parallel_layout`` (``hp_trainer.distributed.layout_validation``) before a
            rank starts (e.g. TP not dividing Qwen3.5's linear-attention heads).

    See Also:
        :titan:`torchtitan.protocols.model_spec.ModelSpec`: TorchTitan's spec.
    """

    name: str
    flavors: dict[str, Any]
    model_cls: type[nn.Module]
    parallelize_fn: Callable[..., nn.Module]  # a ParallelizeFn
    pipelining_fn: Callable[..., Any] | None = None
    state_dict_adapter: type | None = None
    args_from_hf_config: Callable[[Mapping[str, Any], str], Any] | None = None
    sharding: ShardingConfig | None = None
    context_parallel: bool = False
    job_check: Callable[[Any], tuple[str, str, object, str] | None] | None = None
    layout_check: Callable[[Any, Any], str | None] | None = None

    def model_args(self, flavor: str) -> Any:
        """Return the arguments of one flavor.

        Args:
            flavor: Flavor name.

        Returns:
            The model arguments object (a fresh copy).

        Raises:
            ValueError: For an unknown flavor, listing the known ones.

        See Also:
            :titan:`torchtitan.models.llama3.model_registry`: TorchTitan's flavor lookup.
        """
        import copy

        if flavor not in self.flavors:
            raise ValueError(
                f"model {self.name!r} has no flavor {flavor!r}; flavors: " + ", ".join(self.flavors)
            )
        return copy.deepcopy(self.flavors[flavor])

    def build(self, flavor: str, **overrides: Any) -> nn.Module:
        """Build a model of one flavor on the current default device.

        Args:
            flavor: Flavor name.
            **overrides: Fields of the model arguments to replace (e.g. ``max_seq_len``).

        Returns:
            The (uninitialized or default-initialized) model.

        See Also:
            :titan:`torchtitan.protocols.model.BaseModel.Config.build`.
        """
        args = self.model_args(flavor)
        for key, value in overrides.items():
            setattr(args, key, value)
        return self.model_cls(args)


_REGISTRY: dict[str, ModelSpec] = {}


def _load_builtin_models() -> None:
    for name in BUILTIN_MODELS:
        importlib.import_module(f"hp_trainer.models.{name}")  # registers it (once)


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register a model family under ``spec.name``.

    Args:
        spec: The spec.

    Returns:
        ``spec``.

    Raises:
        ValueError: If the name is already registered with a different spec.

    See Also:
        :titan:`torchtitan.protocols.train_spec.register_train_spec`: TorchTitan's former registry.
    """
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


register_spec = register_model_spec
"""HyperParallel's name for :func:`register_model_spec`."""


def get_model_spec(name: str) -> ModelSpec:
    """Return the spec registered under ``name``.

    Args:
        name: Model name (e.g. ``llama3``, ``qwen3``).

    Returns:
        The spec.

    Raises:
        ValueError: For an unknown name, listing the registered ones.

    See Also:
        :titan:`torchtitan.protocols.train_spec.get_train_spec`: TorchTitan's former lookup.
    """
    _load_builtin_models()
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def list_model_specs() -> list[str]:
    """Names of all registered model families.

    Returns:
        Sorted names.

    See Also:
        :titan:`torchtitan.models._supported_models`: TorchTitan's model list.
    """
    _load_builtin_models()
    return sorted(_REGISTRY)
