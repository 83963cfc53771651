"""Expert load statistics: per-expert token counts of a step and their imbalance.

The trainer logs them (min / max / mean / imbalance per MoE layer); they come from
:func:`hp_cp_ep.update_expert_bias` (the step's global counts, also kept on each layer as
``last_load``) or from :func:`expert_load` on any count tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertLoad", "expert_load"]


@dataclass(frozen=True)
class ExpertLoad:
    """The load of one MoE layer's experts over one step.

    Attributes:
        tokens_per_expert: ``[E]`` routed choices per expert (a CPU fp32 tensor).
        min: Fewest choices of an expert.
        max: Most choices of an expert.
        mean: Mean choices per expert.
        imbalance: ``max / mean`` (1.0 is perfect balance; 0.0 when nothing was routed).

    See Also:
        TorchTitan's :titan:`MoE` ``tokens_per_expert`` buffer, which its metrics read.
    """

    tokens_per_expert: torch.Tensor
    min: float
    max: float
    mean: float
    imbalance: float


def expert_load(tokens_per_expert: torch.Tensor) -> ExpertLoad:
    """Summarise per-expert token counts as an :class:`ExpertLoad`.

    Example:
        >>> import torch
        >>> from hp_cp_ep import expert_load
        >>> expert_load(torch.tensor([6.0, 2.0, 0.0, 0.0])).imbalance
        3.0

    See Also:
        :class:`ExpertLoad`.
    """
    counts = tokens_per_expert.detach().to("cpu", torch.float32)
    mean = float(counts.mean()) if counts.numel() else 0.0
    high = float(counts.max()) if counts.numel() else 0.0
    return ExpertLoad(
        tokens_per_expert=counts,
        min=float(counts.min()) if counts.numel() else 0.0,
        max=high,
        mean=mean,
        imbalance=high / mean if mean > 0 else 0.0,
    )
