"""The generic applier of a :class:`~hp_trainer.protocols.sharding.ShardingConfig`."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_trainer._parallel_api import ParallelStyle, parallelize_module
from hp_trainer.protocols.sharding import ShardingConfig

__all__ = ["ComposedStyle", "apply_sharding"]


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
    model: nn.Module, config: ShardingConfig, tp_mesh: DeviceMesh, **options: Any
) -> dict[str, Any]:
    """Shard ``model`` over ``tp_mesh`` as ``config`` declares: one ``parallelize_module`` call.

    Every module whose FQN matches a rule gets that rule's style (the first matching rule wins);
    a rule matching no module is not an error (a pipeline stage holds some modules only).

    Args:
        model: The model (or a pipeline stage of it).
        config: The model's table.
        tp_mesh: 1-D tensor-parallel mesh.
        **options: Passed to the style factories (e.g. ``loss_parallel=True``).

    Returns:
        The plan applied, ``{fqn: style}``.

    Raises:
        ValueError: No module of ``model`` matches any rule (a table for another model).

    See Also:
        :func:`hp_tp.parallelize_module`: what the plan is given to.
    """
    fqns = [name for name, _ in model.named_modules() if name]
    plan = config.plan(fqns, options)
    if not plan and config.tp:
        raise ValueError(
            f"no module of {type(model).__name__} matches the sharding table"
            + (f" ({config.description})" if config.description else "")
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return plan
