"""The trainer's per-step MoE bookkeeping: the auxiliary-loss-free bias update and load metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_cp_ep import (
    ExpertLoad,
    expert_load,
    moe_layers,
    update_expert_bias,
    update_hot_experts,
)
from hp_dtensor import device as hp_device

__all__ = ["ExpertLoadTracker", "collective_device", "format_expert_load"]


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group``'s collectives take.

    A gloo-only group takes host tensors; any other group (NCCL, HCCL, or a group with one
    backend per device type) takes tensors on this rank's compute device, which is the host on a
    CPU job. A CPU tensor on an NCCL group fails ("No backend type associated with device type
    cpu"), so every collective of the tracker builds its tensors here.

    Args:
        group: The process group (None: the default group).

    Returns:
        The device.
    """
    if str(dist.get_backend(group)) == hp_device.BACKEND_GLOO:
        return torch.device(hp_device.DEVICE_TYPE_CPU)
    return hp_device.get_device()


def _gather_names(names: list[str], group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """Every rank's list of names (UTF-8 bytes gathered as tensors on the group's device)."""
    data = torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    longest = max(int(s.item()) for s in sizes)  # once, at set-up
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    out = []
    for size, row in zip(sizes, gathered, strict=True):
        text = bytes(row[: int(size.item())].tolist()).decode()
        out.append(text.split("\n") if text else [])
    return out


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
        hot_expert_replicas: Keyword-only extension: every ``hot_expert_update_interval``
            steps, give the ``K`` most loaded experts of each layer a replica on the least
            loaded EP ranks (:func:`hp_cp_ep.update_hot_experts`, from the step's global load).
        hot_expert_update_interval: Keyword-only extension: steps between two re-plans.

    Raises:
        ValueError: ``hot_expert_replicas > 0`` and some MoE layer's experts are not expert
            parallel (no EP group: nowhere to copy to).

    See Also:
        TorchTitan's :titan:`build_optimizers_with_moe_load_balancing` (its optimizer hook).
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        process_group: dist.ProcessGroup | None,
        *,
        pipeline_group: dist.ProcessGroup | None = None,
        hot_expert_replicas: int = 0,
        hot_expert_update_interval: int = 10,
    ) -> None:
        self.model_parts = list(model_parts)
        self.hot_expert_replicas = hot_expert_replicas
        self.hot_expert_update_interval = hot_expert_update_interval
        self._steps = 0
        if hot_expert_replicas:
            for part in self.model_parts:
                for name, layer in moe_layers(part).items():
                    dispatcher = layer.experts.token_dispatcher
                    if getattr(dispatcher, "ep_group", None) is None:
                        raise ValueError(
                            f"moe.hot_expert_replicas = {hot_expert_replicas} needs expert "
                            f"parallelism, but the experts of {name!r} are not expert parallel "
                            "(set parallelism.expert_parallel_degree > 1)"
                        )
        self.process_group = process_group
        self.pipeline_group = pipeline_group
        self.enabled = any(moe_layers(part) for part in self.model_parts)
        self._stage_layers: list[list[str]] = []
        self._experts = 0
        if pipeline_group is not None:  # some stage holds MoE layers: every stage gathers
            device = collective_device(pipeline_group)
            local = {n: m for part in self.model_parts for n, m in moe_layers(part).items()}
            sizes = {int(m.tokens_per_expert.numel()) for m in local.values()}
            if len(sizes) > 1:
                raise ValueError(f"MoE layers with different expert counts {sorted(sizes)}")
            experts = max(sizes, default=0)
            flag = torch.tensor([experts], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pipeline_group)
            self._experts = int(flag.item())  # once, at set-up
            self.enabled = self._experts > 0
            if self.enabled:  # which layers each stage holds, in the order it sends them
                self._stage_layers = _gather_names(list(local), pipeline_group, device)
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
        self._steps += 1
        if self.hot_expert_replicas and self._steps % self.hot_expert_update_interval == 0:
            for part in self.model_parts:  # this rank's layers, from their global load
                update_hot_experts(part, loads, self.hot_expert_replicas)
        if self.pipeline_group is not None:
            loads = self._gather_stages(loads, self.pipeline_group)
        self.loads = loads
        return loads

    def _gather_stages(
        self, loads: dict[str, ExpertLoad], pipeline_group: dist.ProcessGroup
    ) -> dict[str, ExpertLoad]:
        """The loads of every stage's layers (already global over data parallel), by FQN.

        One all-gather of a ``[layers, experts]`` count tensor per stage (padded to the stage
        with the most MoE layers), on the group's device: no object collective, no pickling.
        """
        device = collective_device(pipeline_group)
        rows = max(len(names) for names in self._stage_layers)
        mine = torch.zeros(rows, self._experts, dtype=torch.float32, device=device)
        rank = dist.get_rank(pipeline_group)
        for i, name in enumerate(self._stage_layers[rank]):
            mine[i] = loads[name].tokens_per_expert.to(device)
        stages = [torch.empty_like(mine) for _ in self._stage_layers]
        dist.all_gather(stages, mine, group=pipeline_group)
        return {
            name: expert_load(counts[i])
            for names, counts in zip(self._stage_layers, stages, strict=True)
            for i, name in enumerate(names)
        }

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
