"""Splitting a decoder into pipeline stages by layer cost, keeping every FQN unchanged.

A decoder here is any module whose top-level children are an input part (e.g.
``tok_embeddings``), a container of blocks (``layers``: an ``nn.ModuleDict`` or
``nn.ModuleList``), and output parts (e.g. ``norm``, ``output``). Its forward must skip a
top-level part that is ``None`` (``h = self.tok_embeddings(x) if self.tok_embeddings else x``),
as TorchTitan's models do.

- :func:`generate_llm_fqn_per_model_part` assigns contiguous parts to stages so that the most
  expensive stage is as cheap as possible; the input and output parts count as
  ``input_weight`` / ``output_weight`` blocks, or every part has its own cost
  (``layer_costs``).
- :func:`split_module_by_fqns` copies the model keeping only the named parts: other blocks are
  removed from the container (which stays, possibly empty; a ``ModuleList`` becomes a
  container keyed by the original indices, so ``layers.5`` stays ``layers.5`` and iteration
  still yields the blocks in order), other top-level parts are set to ``None``. The union of
  the stages' state dicts is the unpipelined model's state dict, so checkpoints load either
  way.
- :func:`pipeline_module_split` builds this rank's stages (loop or V placement) and
  :func:`pipeline_llm` the whole pipeline with its schedule.

See Also:
    TorchTitan's :titan:`torchtitan.distributed.pipeline_parallel`: ``pipeline_llm``,
    ``pipeline_module_split``, ``generate_llm_fqn_per_model_part``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_pp import generators
from hp_pp.schedules import (
    PipelineScheduleRuntime,
    PipelineScheduleSingle,
    get_schedule_class,
)
from hp_pp.stage import PipelineStage

__all__ = [
    "generate_llm_fqn_per_model_part",
    "pipeline_llm",
    "pipeline_module_split",
    "split_module_by_fqns",
]


def _balanced_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty groups minimizing the largest group cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-cost splitting the first i items into k groups.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    sizes: list[int] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def generate_llm_fqn_per_model_part(
    num_stages: int,
    num_layers: int,
    input_weight: int = 1,
    output_weight: int = 1,
    *,
    input_fqns: Sequence[str] = ("tok_embeddings",),
    output_fqns: Sequence[str] = ("norm", "output"),
    layers_fqn: str = "layers",
    layer_costs: Sequence[float] | None = None,
) -> list[list[str]]:
    """The module FQNs of each stage, balanced by cost.

    Args:
        num_stages: Number of stages.
        num_layers: Number of blocks in the ``layers_fqn`` container.
        input_weight: Cost of the input part, in blocks (TorchTitan's default 1).
        output_weight: Cost of the output part, in blocks.
        input_fqns: Keyword-only. Top-level names of the input part.
        output_fqns: Keyword-only. Top-level names of the output part.
        layers_fqn: Keyword-only. Name of the block container.
        layer_costs: Keyword-only. Cost of each of the ``num_layers + 2`` parts (input,
            blocks, output), e.g. measured; overrides the weights.

    Returns:
        One list of FQNs per stage, e.g. ``[["tok_embeddings", "layers.0"], ["layers.1",
        "norm", "output"]]``.

    Raises:
        ValueError: fewer parts than stages, or ``layer_costs`` of the wrong length.

    See Also:
        TorchTitan's :titan:`generate_llm_fqn_per_model_part`
    """
    if num_stages < 1 or num_layers < 0:
        raise ValueError(
            f"need num_stages >= 1 and num_layers >= 0, got {num_stages}, {num_layers}"
        )
    parts: list[list[str]] = [list(input_fqns)]
    parts += [[f"{layers_fqn}.{i}"] for i in range(num_layers)]
    parts.append(list(output_fqns))
    if layer_costs is None:
        costs = [float(input_weight)] + [1.0] * num_layers + [float(output_weight)]
    else:
        costs = [float(c) for c in layer_costs]
        if len(costs) != len(parts):
            raise ValueError(
                f"layer_costs needs {len(parts)} entries (input, {num_layers} blocks, output), "
                f"got {len(costs)}"
            )
    if num_stages > len(parts):
        raise ValueError(
            f"cannot split {num_layers} blocks plus input and output into {num_stages} stages: "
            "some stage would be empty"
        )
    result: list[list[str]] = []
    start = 0
    for size in _balanced_partition(costs, num_stages):
        result.append([fqn for part in parts[start : start + size] for fqn in part])
        start += size
    return result


class _KeptLayers(nn.ModuleDict):
    """The blocks a stage keeps from an ``nn.ModuleList``, keyed by their original index.

    Iterating yields the blocks (like the list did), so a forward written
    ``for layer in self.layers`` still works, and FQNs keep their original indices.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())

    def __getitem__(self, key: Any) -> nn.Module:
        return super().__getitem__(str(key))


def split_module_by_fqns(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """A copy of ``model`` holding only the parts named by ``fqns`` (FQNs unchanged).

    Args:
        model: The whole model (a meta-device model copies for free).
        fqns: Top-level children (``"tok_embeddings"``) and container entries
            (``"layers.3"``) to keep.

    Returns:
        The stage module: a deep copy with other container entries removed and other top-level
        children set to ``None``.

    Raises:
        ValueError: an FQN names no child of ``model``.

    See Also:
        TorchTitan's :titan:`pipeline_module_split` (its per-stage pruning).
    """
    children = dict(model.named_children())
    keep_top: set[str] = set()
    keep_entries: dict[str, set[str]] = {}
    for fqn in fqns:
        top, _, entry = fqn.partition(".")
        if top not in children:
            raise ValueError(f"{fqn!r} names no child of the model; children: {sorted(children)}")
        if entry:
            container = children[top]
            if not isinstance(container, nn.ModuleDict | nn.ModuleList) or entry not in dict(
                container.named_children()
            ):
                raise ValueError(f"{fqn!r}: {top!r} has no entry {entry!r}")
            keep_entries.setdefault(top, set()).add(entry)
        else:
            keep_top.add(top)
    stage = copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if name in keep_top:
            continue
        if name in keep_entries or isinstance(child, nn.ModuleDict | nn.ModuleList):
            # A container keeps the named entries (possibly none: it stays, empty).
            wanted = keep_entries.get(name, set())
            kept = [(k, m) for k, m in child.named_children() if k in wanted]
            if isinstance(child, nn.ModuleDict):
                for key in [k for k, _ in child.named_children() if k not in wanted]:
                    del child[key]
            else:
                setattr(stage, name, _KeptLayers(dict(kept)))
            continue
        setattr(stage, name, None)
    return stage


def pipeline_module_split(
    whole_model: nn.Module,
    pp_mesh: Any,
    pp_schedule: str,
    device: torch.device,
    module_names_per_stage: list[list[str]],
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """This rank's stages and stage modules.

    Args:
        whole_model: The whole model.
        pp_mesh: The pipeline ``DeviceMesh`` (1-D) or a ``ProcessGroup``.
        pp_schedule: The schedule name; its placement (loop or V) decides which stages this
            rank holds.
        device: Device of the stages.
        module_names_per_stage: FQNs per stage (see :func:`generate_llm_fqn_per_model_part`).

    Returns:
        ``(stages, models)`` for the stages this rank holds, in stage order.

    Raises:
        ValueError: the number of stages does not fit the schedule's placement.

    See Also:
        TorchTitan's :titan:`pipeline_module_split`
    """
    group = _group_of(pp_mesh)
    indices, models, num_stages = _local_parts(
        whole_model, group, pp_schedule, module_names_per_stage
    )
    stages = [
        PipelineStage(module, index, num_stages, device, group=group)
        for index, module in zip(indices, models, strict=True)
    ]
    return stages, models


def _group_of(pp_mesh: Any) -> Any:
    return pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh


def _local_parts(
    whole_model: nn.Module, group: Any, pp_schedule: str, module_names_per_stage: list[list[str]]
) -> tuple[list[int], list[nn.Module], int]:
    pp_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    num_stages = len(module_names_per_stage)
    style = generators.STYLE[pp_schedule] if _is_builtin(pp_schedule) else "loop"
    if style == "v" and num_stages != 2 * pp_size:
        raise ValueError(
            f"{pp_schedule} places 2 stages per rank in a V: needs {2 * pp_size} stages, got "
            f"{num_stages}"
        )
    if num_stages % pp_size != 0:
        raise ValueError(f"{num_stages} stages do not divide over {pp_size} pipeline ranks")
    indices = generators.rank_to_stages(rank, pp_size, num_stages, style)
    models = [split_module_by_fqns(whole_model, module_names_per_stage[i]) for i in indices]
    return indices, models, num_stages


def _is_builtin(name: str) -> bool:
    try:
        generators.canonical_schedule_name(name)
    except ValueError:
        return False
    return True


def pipeline_llm(
    model: nn.Module,
    *,
    pp_mesh: Any,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    device: torch.device,
    num_layers: int | None = None,
    stages_per_rank: int | None = None,
    module_fqns_per_model_part: list[list[str]] | None = None,
    input_weight: int = 1,
    output_weight: int = 1,
    parallelize_fn: Callable[[nn.Module], nn.Module | None] | None = None,
    scale_grads: bool = True,
    shape_headers: bool = True,
) -> tuple[PipelineScheduleRuntime, list[nn.Module], bool, bool]:
    """Split a decoder, parallelize each stage module, and build the schedule.

    Args:
        model: The whole decoder (``layers`` container of blocks).
        pp_mesh: The pipeline mesh (1-D) or process group.
        schedule: Schedule name (``"1F1B"``, ``"ZBVZeroBubble"``, ...).
        n_microbatches: Micro-batches per step.
        loss_fn: Loss on the last stage.
        device: Device of the stages.
        num_layers: Number of blocks (default: the length of ``model.layers``).
        stages_per_rank: Stages per rank (default: 1 for single-stage schedules, 2 otherwise).
        module_fqns_per_model_part: Explicit FQNs per stage (overrides the cost split).
        input_weight: Cost of the input part in blocks.
        output_weight: Cost of the output part in blocks.
        parallelize_fn: Applied to each stage module (TP, FSDP, ...) before the stage is made.
        scale_grads: Passed to the schedule.
        shape_headers: Passed to every stage (:class:`PipelineStage`): ``False`` when every
            batch divides evenly into micro-batches, so that no activation message costs a host
            read.

    Returns:
        ``(schedule, model_parts, has_first_stage, has_last_stage)``.

    Raises:
        ValueError: sizes that do not fit the schedule.

    See Also:
        TorchTitan's :titan:`pipeline_llm`
    """
    group = _group_of(pp_mesh)
    pp_size = dist.get_world_size(group)
    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    if stages_per_rank is None:
        stages_per_rank = 1 if single else 2
    if single and stages_per_rank != 1:
        raise ValueError(
            f"{schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}"
        )
    if module_fqns_per_model_part is None:
        if num_layers is None:
            num_layers = len(list(model.get_submodule("layers").children()))
        module_fqns_per_model_part = generate_llm_fqn_per_model_part(
            pp_size * stages_per_rank, num_layers, input_weight, output_weight
        )
    indices, parts, num_stages = _local_parts(model, group, schedule, module_fqns_per_model_part)
    if parallelize_fn is not None:
        parts = [parallelize_fn(part) or part for part in parts]
    stages = [
        PipelineStage(part, index, num_stages, device, group=group, shape_headers=shape_headers)
        for index, part in zip(indices, parts, strict=True)
    ]
    sched: PipelineScheduleRuntime
    if single:
        sched = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)  # type: ignore[arg-type]
    else:
        sched = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return (
        sched,
        parts,
        any(s.is_first for s in stages),
        any(s.is_last for s in stages),
    )
