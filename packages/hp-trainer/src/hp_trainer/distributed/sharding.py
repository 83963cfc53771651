"""The generic applier of a :class:`~hp_trainer.protocols.sharding.ShardingConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from hp_trainer._parallel_api import ParallelStyle, parallelize_module
from hp_trainer.protocols.sharding import EXPERT_LAYOUTS, ShardingConfig

__all__ = ["ComposedStyle", "apply_sharding", "context_parallel_buffers"]

_CP_PLAN_ATTR = "_hp_context_parallel_buffers"


class ComposedStyle(ParallelStyle):
    """Several styles applied to one module, in order (a table gives a module one style).

    Args:
        *styles: The styles; each is applied with this style's ``src_data_rank``.
    """

    def __init__(self, *styles: ParallelStyle) -> None:
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module


def apply_sharding(
    model: nn.Module,
    config: ShardingConfig,
    tp_mesh: DeviceMesh | None,
    *,
    expert_mesh: DeviceMesh | None = None,
    expert_layout: str = "ep",
    cp_mesh: DeviceMesh | None = None,
    dispatcher: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Shard ``model`` as ``config`` declares: one ``parallelize_module`` call per mesh given.

    The ``tp`` section over ``tp_mesh``, then the ``ep`` section over ``expert_mesh``, then the
    ``cp`` section: the placements of the buffers indexed by position, recorded on ``model`` for
    the trainer's context-parallel step, which shards them with the inputs every step
    (:func:`hp_trainer.distributed.sharding.context_parallel_buffers` reads them back). A section
    whose mesh is None is skipped. Every module whose FQN matches a rule gets that rule's style
    (the first matching rule wins); a rule matching no module is not an error (a pipeline stage
    holds some modules only), and neither is an ``ep`` section matching nothing (a stage of
    dense blocks has no experts).

    Args:
        model: The model (or a pipeline stage of it).
        config: The model's table.
        tp_mesh: 1-D tensor-parallel mesh (None: no TP).
        expert_mesh: Keyword-only; the experts' mesh: the EP mesh, the 2-D ``[ep, tp]`` mesh,
            or the TP mesh, as ``expert_layout`` says (None: the experts are not sharded).
        expert_layout: Keyword-only; one of
            ``hp_trainer.protocols.sharding.EXPERT_LAYOUTS`` (default ``"ep"``), given to
            the ``ep`` factories.
        cp_mesh: Keyword-only; the context-parallel mesh (None: no CP).
        dispatcher: Keyword-only; the expert dispatcher's options, over the table's
            ``dispatcher`` key by key, given to the ``ep`` factories as ``dispatcher``.
        **options: Passed to every style factory (e.g. ``loss_parallel=True``).

    Returns:
        The plans applied, ``{fqn: style}`` (``{buffer fqn: placement}`` for CP), all sections.

    Raises:
        ValueError: The ``tp`` or ``cp`` section, given a mesh, matches nothing in ``model`` (a
            table for another model), an unknown ``expert_layout``, or a module in two
            sections.
        TypeError: A ``cp`` rule giving something other than a ``Shard`` placement.

    See Also:
        :func:`hp_tp.parallelize_module`: what each plan is given to.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}; got {expert_layout!r}")
    modules = [name for name, _ in model.named_modules() if name]
    expert_options = {
        **options,
        "expert_layout": expert_layout,
        "dispatcher": {**config.dispatcher, **(dispatcher or {})},
    }
    applied: dict[str, Any] = {}
    for section, mesh, names, opts in (
        ("tp", tp_mesh, modules, options),
        ("ep", expert_mesh, modules, expert_options),
        ("cp", cp_mesh, [name for name, _ in model.named_buffers()], options),
    ):
        if mesh is None or not getattr(config, section):
            continue
        plan = config.plan(names, opts, section)
        if not plan and section != "ep":  # experts: a stage (or model) of dense blocks has none
            raise ValueError(
                f"no {'buffer' if section == 'cp' else 'module'} of {type(model).__name__} "
                f"matches the {section} section of the sharding table"
                + (f" ({config.description})" if config.description else "")
            )
        twice = sorted(set(plan) & set(applied))
        if twice:
            raise ValueError(f"modules {twice} are in two sections of the sharding table")
        if section == "cp":
            wrong = {k: v for k, v in plan.items() if not isinstance(v, Shard)}
            if wrong:
                raise TypeError(f"a cp rule places a buffer with Shard(seq_dim); got {wrong}")
            setattr(model, _CP_PLAN_ATTR, dict(plan))
        else:
            parallelize_module(model, mesh, plan)
        applied.update(plan)
    return applied


def context_parallel_buffers(model: nn.Module) -> dict[str, Shard]:
    """The buffers placed over the CP mesh by :func:`hp_trainer.apply_sharding`.

    Args:
        model: A model (part) given to :func:`hp_trainer.apply_sharding` with a ``cp_mesh``.

    Returns:
        ``{buffer fqn: Shard(seq_dim)}`` (empty when CP was not applied to ``model``).

    See Also:
        :pt:`context_parallel <torch.distributed.tensor.experimental.context_parallel>`:
        PyTorch's CP takes the buffers to shard per call (``buffers``, ``buffer_seq_dims``).
    """
    return dict(getattr(model, _CP_PLAN_ATTR, {}))
