"""HyperParallel-style helpers: state access, managed-parameter test, waiting for reductions.

See Also:
    :pt:`torch.distributed.fsdp.fully_shard`: PyTorch's API these helpers complement.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hp_fsdp.collectives import apply_gradient_scaling_factor
from hp_fsdp.param import MANAGED_FLAG, MODE_ATTR
from hp_fsdp.root_state import ROOTS, RootContext
from hp_fsdp.state import FSDPState, get_state

__all__ = [
    "apply_gradient_scaling_factor",
    "get_hsdp_state",
    "hsdp_sync_stream",
    "infer_fully_shard_param_mode",
    "is_dtensor_managed_param",
]


def get_hsdp_state(module: nn.Module) -> FSDPState | None:
    """Return the hp-fsdp state of ``module`` (HyperParallel's name for ``fully_shard.state``).

    Args:
        module: any module.

    Returns:
        Its state, or None when ``fully_shard`` was not applied to it.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard.state`: PyTorch's accessor.
    """
    return get_state(module)


def is_dtensor_managed_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded (DTensor) parameter owned by a ``fully_shard`` unit.

    Args:
        param: any tensor.

    Returns:
        True for the sharded parameters of hp-fsdp units (and ``replicate``), else False.

    See Also:
        :pt:`torch.distributed.tensor.DTensor`: the parameter type checked.
    """
    return isinstance(param, DTensor) and bool(getattr(param, MANAGED_FLAG, False))


def infer_fully_shard_param_mode(param: torch.Tensor) -> str | None:
    """How a parameter is data-parallel under hp-fsdp (HyperParallel's helper).

    Args:
        param: any tensor, typically a module's registered parameter.

    Returns:
        ``"fsdp"`` (sharded over one axis), ``"hsdp"`` (sharded over the shard axis and
        replicated over the replicate axis), ``"ddp"`` (kept whole, gradients all-reduced:
        ``replicate``, ``replicate_params`` or replicate-only ``dp_mesh_dims``), or None for a
        tensor no ``fully_shard`` unit manages (including ``ignored_params``).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo`: PyTorch keeps the
        same distinction in its mesh-info classes (FSDP / HSDP / DDP).
    """
    if not is_dtensor_managed_param(param):
        return None
    mode = getattr(param, MODE_ATTR, None)
    return mode if isinstance(mode, str) else None


def hsdp_sync_stream(module: nn.Module | None = None) -> None:
    """Wait for pending gradient reductions and write the reduced gradients.

    Reductions normally finish at the end of the backward; after a backward with
    ``set_is_last_backward(False)`` they stay in flight until the next one, or until this
    call. Works on every device.

    Args:
        module: a unit; its root's reductions are finished. None finishes those of every
            root in the process.

    Raises:
        TypeError: when ``module`` is not a fully_shard unit.

    See Also:
        :pt:`torch.distributed.fsdp.FSDPModule.set_is_last_backward`: the setting that leaves
        reductions pending.
    """
    contexts: list[RootContext]
    if module is None:
        contexts = list(ROOTS)
    else:
        state = get_state(module)
        if state is None:
            raise TypeError(
                f"hsdp_sync_stream expects a module fully_shard was applied to, got "
                f"{type(module).__name__}"
            )
        contexts = [state.ctx]
    for ctx in contexts:
        ctx.finish_reductions()
