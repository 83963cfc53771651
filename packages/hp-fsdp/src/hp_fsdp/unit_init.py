"""Building a ``fully_shard`` unit: which modules and parameters join it, and its groups.

Shared by ``fully_shard`` and ``replicate``: the unit's modules (children first, nested units
excluded), its parameters (ignored and tied ones once), moving them to the compute device, and
one :class:`~hp_fsdp.param_group.ParamGroup` per data-parallel mesh.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_init`: PyTorch's initialization helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hp_dtensor.device import DEVICE_TYPE_CPU, get_device, get_device_type, is_accelerator
from hp_fsdp.dynamo import mark_managed_for_dynamo
from hp_fsdp.mesh_info import MeshInfo, is_placement_result, placement_mesh_info
from hp_fsdp.param import MANAGED_FLAG as _MANAGED_FLAG
from hp_fsdp.param_group import ParamGroup, resolve_reshard_after_forward
from hp_fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.state import FSDPState, get_state

__all__ = [
    "default_mesh",
    "managed_modules",
    "managed_params",
    "move_to_device",
    "root_modules",
    "shard_units",
]


def default_mesh() -> DeviceMesh:
    """The 1-D mesh over every rank of the default process group (``mesh=None``)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard(mesh=None) needs an initialized default process group "
            "(torch.distributed.init_process_group or hp_dtensor.device.init_process_group)"
        )
    return init_device_mesh(get_device_type(), (dist.get_world_size(),))


def managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """The modules whose own parameters join this unit, in post-order (children first)."""
    result: list[nn.Module] = []
    visited: set[nn.Module] = set()
    root_set = set(roots)

    def visit(module: nn.Module) -> None:
        if module not in root_set and get_state(module) is not None:
            return
        visited.add(module)
        for child in module.children():
            if child not in visited:
                visit(child)
        result.append(module)

    for root in roots:
        visit(root)
    return result


def managed_params(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The parameters (each once, minus ``ignored``) and buffers of the unit's modules."""
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    seen_params: set[nn.Parameter] = set()
    seen_buffers: set[torch.Tensor] = set()
    for module in modules:
        for param in module.parameters(recurse=False):
            if param in ignored or param in seen_params:
                continue
            if isinstance(param, DTensor) and getattr(param, _MANAGED_FLAG, False):
                raise ValueError(
                    f"a parameter of {type(module).__name__} is already sharded by another "
                    "fully_shard unit (a tied parameter?); put all modules that share a "
                    "parameter in one unit, e.g. fully_shard([module_a, module_b])"
                )
            seen_params.add(param)
            params.append(param)
        for buffer in module.buffers(recurse=False):
            if buffer not in seen_buffers:
                seen_buffers.add(buffer)
                buffers.append(buffer)
    return params, buffers


def move_to_device(tensors: Iterable[torch.Tensor], device: torch.device) -> None:
    """Move parameters and buffers to the compute device in place (meta ones stay)."""
    for tensor in tensors:
        if tensor.device == device or tensor.is_meta:
            continue
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"a DTensor parameter on {tensor.device} cannot be moved to {device} by "
                "fully_shard; move the model first"
            )
        tensor.data = tensor.to(device)


def shard_units(
    roots: tuple[nn.Module, ...],
    mesh: DeviceMesh,
    mesh_info: MeshInfo,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    swap: Callable[[nn.Module], None],
    replicated: frozenset[nn.Parameter] = frozenset(),
) -> None:
    """Build the unit of ``roots`` (shared by ``fully_shard`` and ``replicate``).

    Parameters are grouped by data-parallel mesh: one :class:`ParamGroup` for the unit's mesh,
    plus one per other mesh that ``shard_placement_fn`` names (``ShardPlacementResult``), in
    the order of each mesh's first parameter, as PyTorch groups them.
    """
    device = get_device() if is_accelerator(mesh.device_type) else torch.device(DEVICE_TYPE_CPU)
    auto = reshard_after_forward is None
    managed = managed_modules(roots)
    params, buffers = managed_params(managed, set(ignored_params or ()))
    move_to_device([*params, *buffers], device)
    state = FSDPState(roots, device, mp, auto)
    unknown = replicated - set(params)
    if unknown:
        raise ValueError(
            f"replicate_params must be parameters of this fully_shard unit (not ignored, not "
            f"in a nested unit); {len(unknown)} are not"
        )
    # (shard group, replicate group) -> (mesh info, params, shard dims)
    by_mesh: dict[
        tuple[dist.ProcessGroup, dist.ProcessGroup | None],
        tuple[MeshInfo, list[nn.Parameter], list[int]],
    ] = {}
    for param in params:
        result = shard_placement_fn(param) if shard_placement_fn is not None else None
        param_mesh_info, dim = mesh_info, 0
        if is_placement_result(result):
            if param in replicated:
                raise ValueError(
                    "a parameter in replicate_params cannot get a ShardPlacementResult from "
                    "shard_placement_fn; it is kept whole on the unit's mesh"
                )
            param_mesh_info = placement_mesh_info(result.mesh_info, mesh_info)  # type: ignore[union-attr]
            result = result.placement  # type: ignore[union-attr]
        if isinstance(result, Shard):
            dim = result.dim
        elif result is not None:
            raise ValueError(
                f"Invalid shard_placement_fn result: {result!r}; shard_placement_fn must return "
                "Shard(dim), a ShardPlacementResult or None"
            )
        key = (param_mesh_info.shard_group, param_mesh_info.replicate_group)
        entry = by_mesh.setdefault(key, (param_mesh_info, [], []))
        if entry[0] is not param_mesh_info and entry[0].mesh != param_mesh_info.mesh:
            raise ValueError(
                f"parameters on the meshes {entry[0].mesh} and {param_mesh_info.mesh} use the "
                "same process groups; give every parameter over those ranks the same mesh (a "
                "new group needs a mesh over other ranks, or other dims)"
            )
        entry[1].append(param)
        entry[2].append(dim)
    for group_mesh_info, group_params, dims in by_mesh.values():
        resolved = resolve_reshard_after_forward(
            True if reshard_after_forward is None else reshard_after_forward,
            group_mesh_info.shard_size,
        )
        state.groups.append(
            ParamGroup(
                group_params,
                roots,
                group_mesh_info,
                device,
                resolved,
                dims,
                mp,
                offload,
                replicated & set(group_params),
            )
        )
    mark_managed_for_dynamo(managed)
    for root in roots:
        swap(root)


def root_modules(modules: list[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules of ``modules`` that are not submodules of another one in the list."""
    candidates = list(dict.fromkeys(modules))
    nested: set[nn.Module] = set()
    for module in candidates:
        for sub in module.modules():
            if sub is not module:
                nested.add(sub)
    return tuple(m for m in candidates if m not in nested)
