"""The trainer's per-step MoE bookkeeping: the auxiliary-loss-free bias update and load metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_cp_ep import ExpertLoad, expert_load, moe_layers, update_expert_bias

__all__ = ["ExpertLoadTracker", "format_expert_load"]


class ExpertLoadTracker:
    """After each optimizer step: update every MoE layer's routing bias and keep the step's load.

    The per-expert token counts the MoE layers accumulated over the step (all micro-batches) are
    summed over ``process_group`` (the ranks that route different tokens: data parallel, with
    the ranks expert parallelism borrows) in one all-reduce by
    :func:`hp_cp_ep.update_expert_bias`, which moves each layer's ``expert_bias`` (when the
    layer has one) and resets the counts. A model without MoE layers makes :meth:`step` a no-op
    and :meth:`metrics` None. Under pipeline parallelism each rank updates the layers of its
    own stages, and the loads of all stages are then gathered over ``pipeline_group`` so that
    every rank (the one logging included) reports every layer.

    Args:
        model_parts: The model (or its pipeline stages).
        process_group: The group the counts are summed over (None: no reduction, or the
            default group when one is initialized).
        pipeline_group: Keyword-only extension: the pipeline group whose stages' loads are
            gathered (None: this rank holds every layer). Creating the tracker is then
            collective over it (a stage without MoE layers still joins the gathers).

    See Also:
        TorchTitan's :titan:`build_optimizers_with_moe_load_balancing` (its optimizer hook).
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        process_group: dist.ProcessGroup | None,
        *,
        pipeline_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model_parts = list(model_parts)
        self.process_group = process_group
        self.pipeline_group = pipeline_group
        self.enabled = any(moe_layers(part) for part in self.model_parts)
        if pipeline_group is not None:  # some stage holds MoE layers: every stage gathers
            flag = torch.tensor([int(self.enabled)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pipeline_group)
            self.enabled = bool(flag.item())
        self.loads: dict[str, ExpertLoad] = {}
        """The global load of every MoE layer over the last step, by FQN."""

    def step(self) -> dict[str, ExpertLoad]:
        """Update the biases from the step's global counts; return (and keep) the loads.

        Call it once per optimizer step, after ``optimizer.step()``, on every rank.
        """
        if not self.enabled:
            return {}
        loads: dict[str, ExpertLoad] = {}
        for part in self.model_parts:
            loads.update(update_expert_bias(part, self.process_group))
        if self.pipeline_group is not None:
            loads = self._gather_stages(loads, self.pipeline_group)
        self.loads = loads
        return loads

    @staticmethod
    def _gather_stages(
        loads: dict[str, ExpertLoad], pipeline_group: dist.ProcessGroup
    ) -> dict[str, ExpertLoad]:
        """The loads of every stage's layers (already global over data parallel), by FQN."""
        mine = {name: load.tokens_per_expert.tolist() for name, load in loads.items()}
        stages: list[Any] = [None] * dist.get_world_size(pipeline_group)
        dist.all_gather_object(stages, mine, group=pipeline_group)
        counts = {name: c for stage in stages for name, c in stage.items()}
        return {name: expert_load(torch.tensor(c)) for name, c in counts.items()}

    def metrics(self) -> dict[str, Any] | None:
        """The last step's load as JSONL fields (None without MoE layers or before a step).

        Returns:
            ``moe_tokens_per_expert_min`` / ``_max`` (over all layers and experts),
            ``moe_imbalance`` (the worst layer's ``max / mean``) and ``moe_layers`` (per layer:
            ``min``, ``max``, ``imbalance``, ``tokens_per_expert``).
        """
        if not self.loads:
            return None
        loads = self.loads.values()
        return {
            "moe_tokens_per_expert_min": min(load.min for load in loads),
            "moe_tokens_per_expert_max": max(load.max for load in loads),
            "moe_imbalance": max(load.imbalance for load in loads),
            "moe_layers": {
                name: {
                    "min": load.min,
                    "max": load.max,
                    "imbalance": load.imbalance,
                    "tokens_per_expert": load.tokens_per_expert.tolist(),
                }
                for name, load in self.loads.items()
            },
        }


def format_expert_load(record: dict[str, Any]) -> str:
    """The step-line text of :meth:`ExpertLoadTracker.metrics` fields ("" when absent).

    Args:
        record: A metrics record.

    Returns:
        ``"  experts min M max X imbalance I"`` or ``""``.
    """
    if "moe_imbalance" not in record:
        return ""
    return (
        f"  experts min {record['moe_tokens_per_expert_min']:.0f} "
        f"max {record['moe_tokens_per_expert_max']:.0f} "
        f"imbalance {record['moe_imbalance']:.2f}"
    )
