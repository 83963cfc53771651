"""Float8 training through torchao (``--model.converters float8``).

Every ``nn.Linear`` whose fully qualified name matches none of ``float8.filter_fqns`` is
swapped for torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``): its
three matmuls run in float8 with dynamic scales (tensorwise or rowwise). With FSDP and
``float8.enable_fsdp_float8_all_gather``, the sharded weights are torchao's weight wrapper
(``WeightWithDynamicFloat8CastTensor``), which hp-fsdp all-gathers in float8 through the
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` protocol (a quarter of the fp32 bytes);
``float8.precompute_float8_dynamic_scale_for_fsdp`` computes all their scales in one
all-reduce after each optimizer step (:meth:`Float8Converter.post_optimizer_hook`).

float8 matmuls need both dimensions of a weight divisible by 16: a layer that is not is
refused, naming it, unless ``filter_fqns`` skips it (the skipped layers are logged once).
Needs the optional dependency torchao (``pip install hp-trainer[float8]``); runs on CPU
(``torch._scaled_mm``), so no emulation is needed there.

See Also:
    TorchTitan's Float8 converter (its quantization component, float8 module); torchao's
    ``convert_to_float8_training`` and ``precompute_float8_dynamic_scale_for_fsdp``.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from hp_trainer.components.metrics import logger

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["Float8Converter", "check_linear_dims", "import_optional"]

_FLOAT8_MULTIPLE = 16


def import_optional(module: str, feature: str, extra: str) -> ModuleType:
    """Import an optional dependency, or explain which extra installs it.

    Args:
        module: The module to import (e.g. ``torchao.float8``).
        feature: What needs it (for the message).
        extra: The ``hp-trainer`` extra that installs it.

    Returns:
        The module.

    Raises:
        ImportError: Naming the feature and ``pip install hp-trainer[<extra>]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{feature} needs {module.split('.')[0]} ({module} could not be imported: {error}); "
            f"install it with: pip install 'hp-trainer[{extra}]'"
        ) from error


def check_linear_dims(
    model: nn.Module, filter_fqns: list[str], multiple: int, converter: str
) -> tuple[list[str], list[str]]:
    """Split the model's linear layers into converted and skipped, refusing odd shapes.

    A layer is skipped when one of ``filter_fqns`` occurs in its fully qualified name.

    Args:
        model: The model before conversion.
        filter_fqns: The converter's ``filter_fqns``.
        multiple: What both dimensions of a converted weight must be divisible by.
        converter: The converter's name (for messages).

    Returns:
        ``(converted, skipped)``: fully qualified names of the ``nn.Linear`` layers.

    Raises:
        ValueError: For a layer that is not skipped and has a dimension not divisible by
            ``multiple``, naming it and its shape.
    """
    converted: list[str] = []
    skipped: list[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if any(f in fqn for f in filter_fqns):
            skipped.append(fqn)
            continue
        if module.in_features % multiple or module.out_features % multiple:
            raise ValueError(
                f"{converter}: linear layer {fqn!r} has in_features={module.in_features}, "
                f"out_features={module.out_features}; both must be divisible by {multiple} "
                f"to convert it; add it to {converter}.filter_fqns to keep it in high precision"
            )
        converted.append(fqn)
    if not converted:
        raise ValueError(
            f"{converter}: no linear layer left to convert ({converter}.filter_fqns = "
            f"{filter_fqns!r} skips all of {skipped!r})"
        )
    return converted, skipped


class Float8Converter:
    """Swap the model's linear layers for torchao's ``Float8Linear`` (``float8`` converter).

    Args:
        job_config: The configuration (its ``float8`` section).
        parallel_dims: The job's parallel dimensions (the float8 all-gather and the
            precomputed scales apply only when FSDP shards the weights).

    Raises:
        ImportError: When torchao is not installed (naming ``hp-trainer[float8]``).

    See Also:
        TorchTitan's Float8 converter; torchao's ``Float8LinearConfig``.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        self.float8 = import_optional("torchao.float8", "the float8 converter", "float8")
        cfg = job_config.float8
        self.filter_fqns = list(cfg.filter_fqns)
        """Substrings of the fully qualified names left in high precision."""
        fsdp = parallel_dims.fsdp_enabled
        # rows of a weight split over FSDP's shard axis (dp_shard x cp) and tensor parallel
        self._row_split = parallel_dims.dp_shard * parallel_dims.cp * parallel_dims.tp
        self.float8_all_gather = cfg.enable_fsdp_float8_all_gather and fsdp
        """Whether FSDP all-gathers the weights in float8."""
        self.precompute_scales = cfg.precompute_float8_dynamic_scale_for_fsdp and fsdp
        """Whether the post-optimizer hook precomputes the float8 scales."""
        if cfg.recipe_name == "tensorwise":
            config: Any = self.float8.Float8LinearConfig(
                enable_fsdp_float8_all_gather=self.float8_all_gather, emulate=cfg.emulate
            )
        else:
            config = self.float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name)
            config = dataclasses.replace(config, emulate=cfg.emulate)
        self.config = config
        """torchao's ``Float8LinearConfig``."""
        self.converted: list[str] = []
        """Fully qualified names of the converted layers (after :meth:`convert`)."""
        self.skipped: list[str] = []
        """Linear layers kept in high precision by ``filter_fqns``."""

    def convert(self, model: nn.Module) -> None:
        """Swap every linear layer not in ``filter_fqns`` for ``Float8Linear``, in place.

        Args:
            model: The whole model, before parallelisation.

        Raises:
            ValueError: For a layer whose dimensions are not divisible by 16 (naming it),
                when the filter leaves no layer to convert, or, with the float8 all-gather,
                for a layer whose rows do not divide evenly over the FSDP shard (x TP) ranks
                (torchao's weight wrapper gathers its unpadded shard: an uneven shard would
                fail on the short rank only, at the first all-gather).
        """
        converted, skipped = check_linear_dims(model, self.filter_fqns, _FLOAT8_MULTIPLE, "float8")
        if self.float8_all_gather:
            for fqn in converted:
                rows = int(model.get_submodule(fqn).out_features)  # type: ignore[arg-type]
                if rows % self._row_split:
                    raise ValueError(
                        f"float8: linear layer {fqn!r} has out_features={rows}, not divisible by "
                        f"the FSDP shard degree x tensor-parallel degree ({self._row_split}): "
                        "torchao's float8 all-gather needs every rank to hold as many rows; set "
                        "float8.enable_fsdp_float8_all_gather = false or add the layer to "
                        "float8.filter_fqns"
                    )
        keep = set(converted)
        self.float8.convert_to_float8_training(
            model, config=self.config, module_filter_fn=lambda _m, fqn: fqn in keep
        )
        self.converted, self.skipped = converted, skipped
        logger.info(
            "float8: %d linear layers converted (%s%s), %d kept in high precision by "
            "float8.filter_fqns: %s",
            len(converted),
            "tensorwise" if self.config.cast_config_weight.scaling_granularity.value
            == "tensorwise" else "rowwise",
            ", float8 all-gather" if self.float8_all_gather else "",
            len(skipped),
            ", ".join(skipped) or "none",
        )  # fmt: skip

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Precompute the float8 scales of the FSDP-sharded weights (one all-reduce).

        Does nothing unless ``float8.precompute_float8_dynamic_scale_for_fsdp`` is set and
        FSDP shards the weights (then each all-gather computes its own scale).

        Args:
            model: The model, or this rank's model parts.
        """
        if not self.precompute_scales:
            return
        for part in model if isinstance(model, list) else [model]:
            self.float8.precompute_float8_dynamic_scale_for_fsdp(part)
