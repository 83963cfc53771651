"""``torch.compile`` of each transformer block."""

from __future__ import annotations

import torch
from torch import nn

from hp_trainer.config import CompileConfig

__all__ = ["apply_compile"]


def apply_compile(
    model: nn.Module, compile_config: CompileConfig, *, inside_checkpoint: bool = False
) -> None:
    """Compile the forward of every block of ``model.layers`` (names and state-dict keys unchanged).

    Per-block compilation reuses one compiled graph for all identical blocks. Only ``forward`` is
    compiled, so module hooks (FSDP applied afterwards) run eagerly around the graph.

    Args:
        model: A model with a ``layers`` ``ModuleDict``.
        compile_config: The ``[compile]`` section (``backend``, ``fullgraph``).
        inside_checkpoint: Keyword-only extension: for a block wrapped by activation
            checkpointing, compile the wrapped block and leave the checkpoint eager around it
            (default: compile the wrapper, the checkpoint traced into the graph). Needed when
            the block holds a graph break (context-parallel attention): Dynamo cannot trace a
            checkpoint around one, and would run the whole checkpointed block uncompiled.

    Raises:
        ValueError: If the model has no ``layers``.

    See Also:
        :titan:`torchtitan.distributed.compile.apply_compile`: TorchTitan's per-block compile.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("torch.compile per block needs the model's blocks in model.layers")
    for block in layers.values():
        if inside_checkpoint:
            block = getattr(block, "_checkpoint_wrapped_module", block)
        # Compile the block's forward only: module hooks (FSDP's all-gather/reshard, installed
        # afterwards) stay outside the graph and run eagerly around it.
        compiled = torch.compile(
            block.forward, backend=compile_config.backend, fullgraph=compile_config.fullgraph
        )
        block.forward = compiled
