"""Activation checkpointing of transformer blocks: full, every N-th block, or per op."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hp_trainer.config import ActivationCheckpointConfig

__all__ = ["apply_ac"]

# Ops whose outputs selective per-op AC keeps: compute-heavy kernels and communication.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}


def _op_sac_context() -> Any:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[f"{mode}_mm"] += 1
            # save every other matmul output, recompute the rest
            if counts[f"{mode}_mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in _SAVE_LIST:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def _wrap(block: nn.Module, config: ActivationCheckpointConfig) -> nn.Module:
    if config.mode == "selective" and config.selective_ac_option == "op":
        return ptd_checkpoint_wrapper(
            block,
            context_fn=_op_sac_context,
            preserve_rng_state=config.preserve_rng_state,
        )
    return ptd_checkpoint_wrapper(block, preserve_rng_state=config.preserve_rng_state)


def apply_ac(model: nn.Module, ac_config: ActivationCheckpointConfig) -> None:
    """Wrap the blocks of ``model.layers`` with activation checkpointing (in place).

    ``full`` recomputes every block in backward; ``selective`` with an integer N wraps every
    N-th block; ``selective`` with ``op`` keeps the outputs of matmuls (every other one),
    attention and communication ops and recomputes cheap element-wise ops.

    Args:
        model: A model with a ``layers`` ``ModuleDict``.
        ac_config: The ``[activation_checkpoint]`` section.

    Raises:
        ValueError: If ``mode`` is ``none`` (nothing to apply) or the model has no ``layers``.

    See Also:
        ``torchtitan.distributed.activation_checkpoint.apply_ac``: TorchTitan's AC.
    """
    if ac_config.mode == "none":
        raise ValueError("apply_ac() called with activation_checkpoint.mode = 'none'")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("activation checkpointing needs the model's blocks in model.layers")
    every = 1
    if ac_config.mode == "selective" and ac_config.selective_ac_option != "op":
        every = int(ac_config.selective_ac_option)
    for i, (name, block) in enumerate(list(layers.items())):
        if (i + 1) % every == 0 or every == 1:
            layers.register_module(name, _wrap(block, ac_config))
