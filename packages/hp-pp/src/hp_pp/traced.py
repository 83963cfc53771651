"""Traced pipelines: PyTorch's graph-capture front-end feeding hp-pp's stages and executor.

``pipeline``, ``pipe_split``, ``SplitPoint`` and ``Pipe`` are PyTorch's own objects, re-exported:
they trace a model and cut its graph into one ``GraphModule`` per stage (a tracer, not an
engine). :func:`build_stage` turns one of those stage modules into an hp-pp
:class:`~hp_pp.PipelineStage`, so a traced pipeline runs on hp-pp's executor with every schedule
class (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``, ...) exactly as a hand-split one does.

How values move: hp-pp's stages hand their outputs to the next stage only. The traced graph
may use a value several stages after the one that makes it (a skip connection, or a model
input used late); :func:`build_stage` reads the whole graph and, at each boundary, carries
every value a later stage (or the pipeline's output) still needs, in graph order. A value that
only passes through a stage is forwarded unchanged (its gradient flows back the same way).
PyTorch's own stage sends such values directly to the stage that uses them, and refuses a
model input used after the first stage; here both work.

See Also:
    :pt:`torch.distributed.pipelining.pipeline`, :pt:`torch.distributed.pipelining.build_stage`
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import (  # interop: torch's tracer
    Pipe,
    SplitPoint,
    pipe_split,
    pipeline,
)

from hp_pp.stage import PipelineStage, PipeliningMetadataError

__all__ = ["Pipe", "SplitPoint", "build_stage", "pipe_split", "pipeline"]


def _stage_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_module"]


def _producer(node: fx.Node, stage_of: dict[fx.Node, int]) -> int:
    """The stage that makes ``node`` (``-1``: a model input)."""
    if node.op == "placeholder":
        return -1
    if node in stage_of:
        return stage_of[node]
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, fx.Node):
            return _producer(source, stage_of)
    raise PipeliningMetadataError(
        f"the traced pipeline's graph has a node {node.format_node()} outside every stage; "
        "build_stage handles graphs of stage calls, their outputs' items and model inputs"
    )


class _TracedPlan:
    """What each stage of a traced pipeline takes and hands on (the same on every rank)."""

    def __init__(self, graph: fx.Graph, num_stages: int) -> None:
        nodes = _stage_nodes(graph)
        if len(nodes) != num_stages:
            raise PipeliningMetadataError(
                f"the traced pipeline's graph calls {len(nodes)} stage modules but pipe_info "
                f"says num_stages={num_stages}"
            )
        self.stage_nodes = nodes
        stage_of = {n: i for i, n in enumerate(nodes)}
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        outputs = [n for n in graph.nodes if n.op == "output"]
        self.output_node = outputs[0]
        # The value nodes (model inputs, stage outputs, items of stage outputs) each stage uses.
        self.getitems: dict[int, list[fx.Node]] = {i: [] for i in range(num_stages)}
        last_use: dict[fx.Node, int] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                self.getitems[_producer(node, stage_of)].append(node)
        for i, node in enumerate(nodes):
            for used in node.all_input_nodes:
                _producer(used, stage_of)
                last_use[used] = max(last_use.get(used, -1), i)
        for used in self.output_node.all_input_nodes:
            last_use[used] = num_stages
        order = {n: k for k, n in enumerate(graph.nodes)}
        self.carried: list[list[fx.Node]] = []
        for boundary in range(num_stages - 1):
            live = [n for n, last in last_use.items() if _producer(n, stage_of) <= boundary < last]
            self.carried.append(sorted(live, key=order.__getitem__))
        self.num_stages = num_stages


class _TracedStage(PipelineStage):
    """A :class:`PipelineStage` whose submodule is one stage of a traced pipeline: it maps
    the values carried from the previous stage to the stage module's inputs and hands on what
    later stages need."""

    _plan: _TracedPlan

    def _forward_submodule(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        plan, index = self._plan, self.stage_index
        env: dict[fx.Node, Any] = {}
        if index == 0:
            env.update(_bind_model_inputs(plan.placeholders, inputs, kwargs))
        else:
            carried = plan.carried[index - 1]
            if len(inputs) != len(carried):
                raise PipeliningMetadataError(
                    f"stage {index} received {len(inputs)} values but the traced pipeline "
                    f"carries {len(carried)} into it"
                )
            env.update(zip(carried, inputs, strict=True))
        node = plan.stage_nodes[index]
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs_in = fx.node.map_arg(node.kwargs, env.__getitem__)
        output = self.submod(*args, **kwargs_in)
        env[node] = output
        for item in plan.getitems[index]:
            source, index_in = item.args[0], item.args[1]
            assert isinstance(source, fx.Node)
            env[item] = env[source][index_in]
        if index == plan.num_stages - 1:
            result = plan.output_node.args[0]
            if result is node or (isinstance(result, tuple | list) and list(result) == [node]):
                return output  # the stage module's own output, as torch's last stage returns
            return fx.node.map_arg(result, env.__getitem__)
        out = []
        for value_node in plan.carried[index]:
            value = env[value_node]
            if (
                isinstance(value, torch.Tensor)
                and value.requires_grad
                and value_node is not node
                and value_node not in plan.getitems[index]
            ):
                # Passing through: a view, so the gradient that comes back reaches the input.
                value = value.view_as(value)
            out.append(value)
        return tuple(out)


def _bind_model_inputs(
    placeholders: list[fx.Node], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[fx.Node, Any]:
    if len(args) > len(placeholders):
        raise TypeError(
            f"the traced model takes {len(placeholders)} inputs "
            f"({[str(p.target) for p in placeholders]}), got {len(args)} positional arguments"
        )
    env: dict[fx.Node, Any] = dict(zip(placeholders, args, strict=False))
    for p in placeholders[len(args) :]:
        name = str(p.target)
        if name in kwargs:
            env[p] = kwargs[name]
        elif p.args:
            env[p] = p.args[0]  # the input's default value
        else:
            raise TypeError(f"the traced model's input {name!r} was not given to step()")
    return env


def build_stage(
    stage_module: nn.Module,
    stage_index: int,
    pipe_info: Any,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> PipelineStage:
    """An hp-pp stage for one stage module of a traced pipeline.

    Args:
        stage_module: ``pipe.get_stage_module(stage_index)`` of a ``hp_pp.pipeline`` trace.
        stage_index: Index of this stage.
        pipe_info: ``pipe.info()`` of the same trace (its graph and number of stages).
        device: Device of the stage (the module is moved there unless it is on ``meta``).
        group: The pipeline process group (default: the world group).

    Returns:
        A :class:`~hp_pp.PipelineStage` that every hp-pp schedule class runs.

    Raises:
        ValueError: ``pipe_info`` is not a trace's ``PipeInfo``, a trace with the loss inside
            the model (give the schedule ``loss_fn`` instead), or a graph other than stage
            calls (as :class:`~hp_pp.PipeliningMetadataError`).

    See Also:
        :pt:`torch.distributed.pipelining.build_stage`
    """
    graph = getattr(pipe_info, "graph", None)
    num_stages = getattr(pipe_info, "num_stages", None)
    if not isinstance(graph, fx.Graph) or not isinstance(num_stages, int):
        raise ValueError(
            f"pipe_info must be a traced pipeline's pipe.info() (with a graph and num_stages), "
            f"got {type(pipe_info).__name__}"
        )
    if getattr(pipe_info, "has_loss_and_backward", False):
        raise ValueError(
            "build_stage: the trace holds the loss (has_loss_and_backward=True); trace the model "
            "without it and pass loss_fn= to the schedule"
        )
    plan = _TracedPlan(graph, num_stages)
    if not any(p.is_meta for p in stage_module.parameters()):
        stage_module.to(device)
    stage = _TracedStage(stage_module, stage_index, num_stages, device, group=group)
    stage._plan = plan
    return stage
