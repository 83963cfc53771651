"""The autograd node that runs a unit's post-backward when its inputs' gradients are ready.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hp_fsdp.param_group import ParamGroup

__all__ = ["PostBackwardTrigger"]


class PostBackwardTrigger(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs the unit's post-backward.

    Written with ``setup_context`` (and a ``jvp`` that passes tangents through) so functorch
    transforms and forward-mode AD (``torch.func.jvp``) can run through a sharded module.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, group_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The group is not differentiable: forward-mode tangents pass straight through.
        return tangents
