"""``torch.compile`` of each transformer block."""

from __future__ import annotations

from torch import nn

from hp_trainer.config import CompileConfig

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, compile_config: CompileConfig) -> None:
    """Compile every block of ``model.layers`` in place (names and state-dict keys unchanged).

    Per-block compilation reuses one compiled graph for all identical blocks and composes with
    FSDP applied afterwards.

    Args:
        model: A model with a ``layers`` ``ModuleDict``.
        compile_config: The ``[compile]`` section (``backend``, ``fullgraph``).

    Raises:
        ValueError: If the model has no ``layers``.

    See Also:
        ``torchtitan.distributed.compile.apply_compile``: TorchTitan's per-block compile.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("torch.compile per block needs the model's blocks in model.layers")
    for block in layers.values():
        block.compile(backend=compile_config.backend, fullgraph=compile_config.fullgraph)
