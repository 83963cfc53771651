"""``replicate``: DDP-style data parallelism on the hp-fsdp engine.

Parameters stay whole on every rank (``Replicate()`` DTensors) and gradients are all-reduced
(averaged) once per module after its backward, overlapping earlier modules' backward, exactly
as PyTorch's FSDP-based ``replicate`` does.

See Also:
    :pt:`torch.distributed._composable.replicate_with_fsdp.replicate`: PyTorch's function.
"""

from __future__ import annotations

from typing import cast

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hp_fsdp.fsdp_module import FSDPModule, _unimplemented_deepcopy
from hp_fsdp.mesh_info import DataParallelMeshDims, MeshInfo
from hp_fsdp.policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    to_mp_policy,
    to_offload_policy,
)
from hp_fsdp.state import get_state
from hp_fsdp.unit_init import default_mesh, shard_units

__all__ = ["ReplicateModule", "replicate"]

_CLS_TO_REPLICATE_CLS: dict[type, type] = {}


class ReplicateModule(FSDPModule):
    """Mix-in class of every module ``replicate`` was applied to (``Replicate<Original>``).

    It has all :class:`FSDPModule` methods (``set_requires_gradient_sync``,
    ``set_all_reduce_hook``, ...).

    See Also:
        :pt:`torch.distributed._composable.replicate_with_fsdp.ReplicateModule`: PyTorch's class.
    """

    _orig_cls_mro_index: int = 3


def _swap_replicate_class(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLS_TO_REPLICATE_CLS.get(cls)
    if new_cls is None:
        new_cls = type(
            f"Replicate{cls.__name__}",
            (ReplicateModule, cls),
            {"__deepcopy__": _unimplemented_deepcopy},
        )
        _CLS_TO_REPLICATE_CLS[cls] = new_cls
    module.__class__ = new_cls


def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ReplicateModule:
    """Replicate a module's parameters over a 1-D mesh and all-reduce its gradients.

    The module's parameters (those not in a nested ``replicate``/``fully_shard`` unit) become
    ``nn.Parameter`` DTensors placed ``Replicate()``; after the module's backward their
    gradients are averaged over the mesh with one all-reduce. Apply it bottom-up like
    ``fully_shard``. Works on every device.

    Args:
        module: the module.
        mesh: a 1-D mesh (None: all ranks of the default group).
        mp_policy: the mixed-precision policy.
        offload_policy: the offload policy.
        ignored_params: parameters left alone.
        dp_mesh_dims: PyTorch's SPMD-mesh option; not supported yet (raises).

    Returns:
        The module, with its class swapped to ``Replicate<Original>``.

    Raises:
        ValueError: for a mesh that is not 1-D, or a module already wrapped.
        NotImplementedError: for ``dp_mesh_dims`` or DTensor parameters.

    See Also:
        :pt:`torch.distributed._composable.replicate_with_fsdp.replicate`: PyTorch's function.
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "hp_fsdp.replicate does not support dp_mesh_dims yet; pass the 1-D data-parallel "
            "mesh as mesh instead"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate expects an nn.Module, got {type(module).__name__}")
    if get_state(module) is not None:
        raise ValueError(f"replicate or fully_shard was already applied to {type(module).__name__}")
    if mesh is None:
        mesh = default_mesh()
    if mesh.ndim != 1:
        raise ValueError(f"replicate expects a 1-D DeviceMesh, got a {mesh.ndim}-D mesh {mesh}")
    mesh_info = MeshInfo(mesh, replicate_only=True)
    shard_units(
        (module,),
        mesh,
        mesh_info,
        False,
        None,
        to_mp_policy(mp_policy),
        to_offload_policy(offload_policy),
        ignored_params,
        _swap_replicate_class,
    )
    return cast(ReplicateModule, module)
