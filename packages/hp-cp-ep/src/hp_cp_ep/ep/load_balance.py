"""The auxiliary-loss-free load balancing update of the experts' routing bias.

Every :class:`~hp_cp_ep.MoE` accumulates the routed choices of its forwards in the
``tokens_per_expert`` buffer (this rank's tokens, all micro-batches of the step). After the
optimizer step the trainer calls :func:`update_expert_bias` (or registers it as an optimizer hook
with :func:`register_expert_bias_update`): the counts of every MoE layer are summed over the
data-parallel ranks in *one* all-reduce, each layer's ``expert_bias`` moves by
``load_balance_coeff * sign(mean - count)`` (centred, so the bias does not drift), the counts are
reset, and the step's global load is returned and kept on the layer as ``last_load`` for metrics.
As every replica applies the same update to the same summed counts, the biases stay identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hp_cp_ep.ep.moe import MoE
from hp_cp_ep.ep.stats import ExpertLoad
from hp_dtensor.device import DEVICE_TYPE_CPU

__all__ = ["moe_layers", "register_expert_bias_update", "update_expert_bias"]


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every :class:`~hp_cp_ep.MoE` in ``model`` by fully qualified name.

    See Also:
        :pt:`torch.nn.Module.named_modules`.
    """
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def update_expert_bias(
    model: nn.Module, process_group: dist.ProcessGroup | None = None
) -> dict[str, ExpertLoad]:
    """Apply the auxiliary-loss-free bias update to every MoE layer of ``model``; reset counts.

    Call it once per optimizer step, after ``optimizer.step()``. The counts of all layers are
    stacked and all-reduced (sum) in one collective over ``process_group``: pass the group of
    ranks that see *different* tokens and hold replicas of the router (data parallel, including
    the ranks expert parallelism borrows; not the tensor-parallel ranks, which see the same
    tokens). ``None`` uses the default group when one is initialized, else no reduction. The
    summaries of all layers are read on the host at once: one host sync per call, whatever the
    number of layers.

    Args:
        model: A model containing :class:`~hp_cp_ep.MoE` layers.
        process_group: The data-parallel group the counts are summed over.

    Returns:
        The global load of each MoE layer over the step, by FQN (also stored on the layer as
        ``last_load``).

    See Also:
        TorchTitan's :titan:`build_optimizers_with_moe_load_balancing` (its optimizer hook);
        DeepSeek-V3's auxiliary-loss-free load balancing.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = torch.stack([layer.tokens_per_expert for layer in layers.values()])
    if dist.is_initialized():
        dist.all_reduce(counts, group=process_group)
    loads: dict[str, ExpertLoad] = {}
    with torch.no_grad():
        for layer, layer_counts in zip(layers.values(), counts, strict=True):
            if layer.expert_bias is not None and layer.load_balance_coeff is not None:
                delta = layer.load_balance_coeff * torch.sign(layer_counts.mean() - layer_counts)
                layer.expert_bias.add_(delta - delta.mean())
            layer.tokens_per_expert.zero_()
        # The summaries of every layer in one host read per step (not one copy per layer): the
        # counts go to the host asynchronously, the read of min / max / mean completes them.
        counts = counts.detach().to(torch.float32)
        host_counts = counts.to(DEVICE_TYPE_CPU, non_blocking=True)
        summary = torch.stack([counts.amin(1), counts.amax(1), counts.mean(1)], 1).tolist()
    for (name, layer), host_row, (low, high, mean) in zip(
        layers.items(), host_counts, summary, strict=True
    ):
        loads[name] = ExpertLoad(
            tokens_per_expert=host_row,
            min=low,
            max=high,
            mean=mean,
            imbalance=high / mean if mean > 0 else 0.0,
        )
        layer.last_load = loads[name]
    return loads


def register_expert_bias_update(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    process_group: dist.ProcessGroup | None = None,
) -> RemovableHandle:
    """Run :func:`update_expert_bias` after every ``optimizer.step()``.

    Args:
        optimizer: The optimizer whose steps trigger the update.
        model: The model holding the MoE layers.
        process_group: The data-parallel group (see :func:`update_expert_bias`).

    Returns:
        The hook handle (``.remove()`` to stop).

    See Also:
        :pt:`torch.optim.Optimizer.register_step_post_hook`; TorchTitan registers its bias update
        as an optimizer step pre-hook (``build_optimizers_with_moe_load_balancing``).
    """

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        update_expert_bias(model, process_group)

    post_hook: Callable[[torch.optim.Optimizer, Any, Any], None] = hook
    return optimizer.register_step_post_hook(post_hook)
