"""MXFP8 training through torchao (``--model.converters mx``).

Every ``nn.Linear`` whose fully qualified name matches none of ``mx.filter_fqns`` gets
torchao's MXFP8 training weight (``torchao.quantization.quantize_`` with
``MXFP8TrainingOpConfig``): its matmuls quantize their operands to float8 in blocks of 32
elements sharing one power-of-two (e8m0) scale. The weight is a wrapper tensor subclass with
``fsdp_pre_all_gather``/``fsdp_post_all_gather``, so hp-fsdp shards and gathers it like any
parameter.

The ``mxfp8_rceil`` recipes run torchao's MXFP8 kernels: they need a CUDA device of compute
capability 10.0 or newer (Blackwell) and Triton, and are refused elsewhere with a message
naming the requirement (``benchmarks/gpu/float8_check.py`` checks them on such a device). The
``mxfp8_emulated_rceil`` recipe quantizes with PyTorch-native ops and runs anywhere, CPU
included (for tests; not faster). Both dimensions of a converted weight must be divisible by
32 (one scale block), or the layer must be skipped by ``filter_fqns``.

See Also:
    TorchTitan's MXFP8 converter (its quantization component, mx module); torchao's
    ``MXFP8TrainingOpConfig``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_dtensor import device as hp_device
from hp_trainer.components.converters.float8 import check_linear_dims, import_optional
from hp_trainer.components.metrics import logger

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["MXConverter", "mxfp8_kernels_available"]

_MX_BLOCK = 32
_MIN_CAPABILITY = (10, 0)
_EMULATED = "mxfp8_emulated_rceil"


def mxfp8_kernels_available() -> tuple[bool, str]:
    """Whether torchao's MXFP8 kernels can run here, and why not.

    Returns:
        ``(available, reason)``: the reason names what is missing (empty when available).
    """
    device_type = hp_device.get_device_type()
    if device_type != hp_device.DEVICE_TYPE_CUDA:
        return False, f"this process computes on {device_type!r}"
    capability = tuple(getattr(torch, device_type).get_device_capability())
    if capability < _MIN_CAPABILITY:
        return False, f"the device has compute capability {capability[0]}.{capability[1]}"
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    return True, ""


class MXConverter:
    """Give the model's linear layers torchao's MXFP8 training weights (``mx`` converter).

    Args:
        job_config: The configuration (its ``mx`` section).
        parallel_dims: The job's parallel dimensions.

    Raises:
        ImportError: When torchao is not installed (naming ``hp-trainer[float8]``).
        ValueError: For an MXFP8-kernel recipe where the kernels cannot run (not a CUDA device
            of compute capability >= 10.0 with Triton), naming the requirement and the
            emulated recipe.

    See Also:
        TorchTitan's MXFP8 converter; torchao's ``MXFP8TrainingOpConfig``.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        cfg = job_config.mx
        self.recipe_name = cfg.recipe_name
        """torchao's MXFP8 recipe."""
        if cfg.recipe_name != _EMULATED:
            available, reason = mxfp8_kernels_available()
            if not available:
                raise ValueError(
                    f"mx.recipe_name = {cfg.recipe_name!r} runs torchao's MXFP8 kernels, which "
                    f"need a CUDA device of compute capability >= 10.0 (Blackwell) and Triton; "
                    f"{reason}. Use mx.recipe_name = {_EMULATED!r} to emulate MXFP8 here"
                )
        self._mx = import_optional(
            "torchao.prototype.moe_training.config", "the mx converter", "float8"
        )
        self._quantize = import_optional("torchao.quantization", "the mx converter", "float8")
        recipe = self._mx.MXFP8TrainingRecipe(cfg.recipe_name)
        self.config: Any = self._mx.MXFP8TrainingOpConfig.from_recipe(recipe)
        """torchao's ``MXFP8TrainingOpConfig``."""
        self.filter_fqns = list(cfg.filter_fqns)
        """Substrings of the fully qualified names left in high precision."""
        self.converted: list[str] = []
        """Fully qualified names of the converted layers (after :meth:`convert`)."""
        self.skipped: list[str] = []
        """Linear layers kept in high precision by ``filter_fqns``."""

    def convert(self, model: nn.Module) -> None:
        """Give every linear layer not in ``filter_fqns`` an MXFP8 training weight, in place.

        Args:
            model: The whole model, before parallelisation.

        Raises:
            ValueError: For a layer whose dimensions are not divisible by 32 (naming it), or
                when the filter leaves no layer to convert.
        """
        converted, skipped = check_linear_dims(model, self.filter_fqns, _MX_BLOCK, "mx")
        keep = set(converted)
        self._quantize.quantize_(model, self.config, filter_fn=lambda _m, fqn: fqn in keep)
        self.converted, self.skipped = converted, skipped
        logger.info(
            "mx: %d linear layers converted (%s), %d kept in high precision by mx.filter_fqns: %s",
            len(converted),
            self.recipe_name,
            len(skipped),
            ", ".join(skipped) or "none",
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """MXFP8 scales are computed per block at each matmul: nothing to precompute.

        Args:
            model: The model, or this rank's model parts.
        """
        del model
