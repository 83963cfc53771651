"""The public API of hp-fsdp: ``fully_shard`` and the module-level functions.

The module class it swaps in lives in ``hp_fsdp.fsdp_module`` (re-exported here).

See Also:
    :pt:`torch.distributed.fsdp.fully_shard`: PyTorch's FSDP2 API.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast, overload

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from hp_dtensor.device import pin_memory_available
from hp_fsdp.errors import FSDPUsageError
from hp_fsdp.fsdp_module import (
    FSDPModule,
    HSDPModule,
    UnshardHandle,
    _states_of,
    _swap_class,
    disable_fsdp_module_new_init,
    get_cls_to_fsdp_cls,
)
from hp_fsdp.mesh_info import (
    DataParallelMeshDims,
    ShardPlacementResult,
    _spmd_mesh_info,
    mesh_info_from_mesh,
)
from hp_fsdp.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    to_mp_policy,
    to_offload_policy,
)
from hp_fsdp.state import FSDPState, get_state
from hp_fsdp.unit_init import default_mesh, root_modules, shard_units

__all__ = [
    "FSDPModule",
    "HSDPModule",
    "UnshardHandle",
    "disable_fsdp_module_new_init",
    "fully_shard",
    "get_cls_to_fsdp_cls",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    replicate_params: set[nn.Parameter] | None = ...,
    comm_fusion: bool = ...,
    comm_fusion_zero_copy: bool | None = ...,
    sharded_accumulated_grad: bool = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    replicate_params: set[nn.Parameter] | None = ...,
    comm_fusion: bool = ...,
    comm_fusion_zero_copy: bool | None = ...,
    sharded_accumulated_grad: bool = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    replicate_params: set[nn.Parameter] | None = None,
    comm_fusion: bool = True,
    comm_fusion_zero_copy: bool | None = None,
    sharded_accumulated_grad: bool = False,
) -> FSDPModule | list[FSDPModule]:
    """Shard a module's parameters over a data-parallel mesh (FSDP, or HSDP on a 2-D mesh).

    Same contract as PyTorch's ``fully_shard``, run by hp-fsdp's own engine: the parameters of
    ``module`` (those not already in a nested unit, minus ``ignored_params``, tied ones once)
    become one unit, replaced by ``nn.Parameter`` DTensors placed ``Shard(0)`` (or
    ``(Replicate(), Shard(0))`` on a 2-D replicate x shard mesh). Before forward the unit is
    all-gathered with one collective; after forward it is freed (per ``reshard_after_forward``);
    in backward it is gathered again and its gradients reduce-scattered with one collective
    (plus an all-reduce over the replicate axis for HSDP), overlapping earlier units' backward.
    Apply it bottom-up: blocks first, then the root. Numerics equal PyTorch's bit for bit.
    DTensor parameters of a 1-D (TP or EP) or 2-D (EP x TP) mesh are sharded through their
    local tensors, with torch's placements on the concatenated (dp, ...) mesh
    (``_StridedShard`` where a model-parallel placement shards the same dim).

    Args:
        module: a module, or a list of modules forming one unit.
        mesh: the 1-D or 2-D data-parallel mesh; None means all ranks of the default group.
        reshard_after_forward: True (free after forward), False (keep), None (True except for
            the root), or an int k: keep a 1/k share after forward, gathered within groups of k
            ranks in backward (k must divide the shard size; 1 means False).
        shard_placement_fn: maps a parameter to ``Shard(dim)`` (None: ``Shard(0)``), or to a
            ``ShardPlacementResult`` (ours or PyTorch's) naming another mesh for it, e.g.
            experts sharded over their own "efsdp" mesh: the unit then holds one parameter
            group per mesh (one all-gather and one reduce-scatter each), as in PyTorch.
        mp_policy: the mixed-precision policy (ours or PyTorch's).
        offload_policy: the offload policy (ours or PyTorch's).
        ignored_params: parameters left alone (not sharded, not reduced).
        dp_mesh_dims: the data-parallel dim names of ``mesh``, a full multi-axis SPMD mesh
            whose parameters are already DTensors with ``Replicate()`` on those dims: FSDP
            shards over the ``shard`` dim(s) (several are flattened into one axis) and
            replicates (all-reduces) over the ``replicate`` dim(s); with ``replicate`` only,
            parameters stay whole and gradients are all-reduced (DDP). The other dims keep
            their placements. Not with an int ``reshard_after_forward`` (as in PyTorch).
        replicate_params: HyperParallel's extension: parameters of this unit kept whole
            (``Replicate()`` on every data-parallel dim) and all-reduced (averaged) over all
            data-parallel ranks with one collective after the unit's backward, instead of
            sharded. Works on 1-D, HSDP and ``dp_mesh_dims`` meshes.
        comm_fusion: one fused collective per unit (default); False issues one all-gather and
            one reduce-scatter per parameter (for debugging; numbers may differ in the last
            bits at world sizes that are not powers of two).
        comm_fusion_zero_copy: keep the unit's local shards in one flat buffer that is the
            all-gather input itself (no copy-in when the parameters are gathered in their own
            dtype). None means False.
        sharded_accumulated_grad: under ``set_requires_gradient_sync(False)`` still
            reduce-scatter every micro-batch and accumulate sharded gradients (HSDP: the
            replicate-axis all-reduce waits for the synced micro-batch). Saves the unsharded
            gradient memory; the summation order differs from torch's (compare with a
            tolerance).

    Returns:
        The module (or list), with its class swapped to ``FSDP<Original>``.

    Raises:
        ValueError: for a bad mesh, ``reshard_after_forward`` or policy, or pinned memory
            without an accelerator.
        TypeError: for a non-module argument or unknown policy type.
        NotImplementedError: as in PyTorch, for an int ``reshard_after_forward`` with
            ``dp_mesh_dims`` or DTensor parameters, and DTensor parameters on a mesh of more
            than two dims without ``dp_mesh_dims``; also an int ``reshard_after_forward`` with
            ``replicate_params``.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: PyTorch's FSDP2 API.
    """
    if isinstance(module, nn.Module):
        roots: tuple[nn.Module, ...] = (module,)
    elif isinstance(module, list) and module and all(isinstance(m, nn.Module) for m in module):
        roots = root_modules(module)
    else:
        raise TypeError(
            f"fully_shard expects an nn.Module or a non-empty list of them, got {module!r}"
        )
    for root in roots:
        if isinstance(root, nn.ModuleList | nn.ModuleDict) and (
            type(root).forward is nn.Module.forward
        ):
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"{type(root).__name__} has no forward; wrap its children or the parent module"
            )
        if get_state(root) is not None:
            raise FSDPUsageError(
                "Each distinct composable distributed API can only be applied to a module once: "
                f"fully_shard was already applied to {type(root).__name__}"
            )
    mp = to_mp_policy(mp_policy)
    offload = to_offload_policy(offload_policy)
    if isinstance(offload, CPUOffloadPolicy) and offload.pin_memory and not pin_memory_available():
        raise ValueError(
            "CPUOffloadPolicy(pin_memory=True) needs an accelerator for pinned host memory; "
            "on a CPU-only machine use CPUOffloadPolicy(pin_memory=False)"
        )
    if mesh is None:
        mesh = default_mesh()
    if dp_mesh_dims is not None:
        if not isinstance(reshard_after_forward, bool | None):
            raise NotImplementedError(
                "fully_shard(dp_mesh_dims=...) does not support an int reshard_after_forward, "
                f"got {reshard_after_forward!r}"
            )
        mesh_info = _spmd_mesh_info(mesh, dp_mesh_dims)
        mesh = mesh_info.mesh
    else:
        mesh_info = mesh_info_from_mesh(mesh)
    replicated = frozenset(replicate_params or ())
    if replicated and not isinstance(reshard_after_forward, bool | None):
        raise NotImplementedError(
            "fully_shard(replicate_params=...) does not support an int reshard_after_forward"
        )
    shard_units(
        roots,
        mesh,
        mesh_info,
        reshard_after_forward,
        shard_placement_fn,
        mp,
        offload,
        ignored_params,
        _swap_class,
        replicated,
    )
    for group in get_state(roots[0]).groups:  # type: ignore[union-attr]
        group.configure(comm_fusion=bool(comm_fusion))
        group.configure(comm_fusion_zero_copy=bool(comm_fusion_zero_copy))
        group.configure(sharded_accumulated_grad=bool(sharded_accumulated_grad))
    if isinstance(module, nn.Module):
        return cast(FSDPModule, module)
    return [cast(FSDPModule, m) for m in module]


def _fully_shard_state(module: nn.Module) -> FSDPState | None:
    """Return the hp-fsdp state of ``module`` (None when fully_shard was not applied).

    Args:
        module: any module.

    Returns:
        Its state, or None.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard.state`: PyTorch's accessor.
    """
    return get_state(module)


fully_shard.state = _fully_shard_state  # type: ignore[attr-defined]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run a unit's pre/post-forward logic (unshard, reshard, backward hooks) around a method.

    For a module that is not a fully_shard unit this does nothing, as in PyTorch.

    Args:
        module: the unit.
        method_name: the name of a method called instead of ``forward`` (e.g. ``generate``).

    Raises:
        ValueError: when the module has no such method.

    See Also:
        :pt:`torch.distributed.fsdp.register_fsdp_forward_method`: PyTorch's function.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    original = getattr(module, method_name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = module._get_fsdp_state()
        args, kwargs = state._pre_forward(module, args, kwargs)
        output = original(*args, **kwargs)
        return state._post_forward(module, args, output)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots share one communication context (call before their first forward).

    The roots (e.g. the model chunks of a pipeline stage) then share the process groups
    hp-fsdp creates lazily (``reshard_after_forward=k`` groups, separate reduce-scatter groups)
    and the once-only hint logging, instead of creating their own.

    Args:
        modules: the root units.

    Raises:
        TypeError: for a module that is not a fully_shard unit.
        ValueError: for an empty list.

    See Also:
        :pt:`torch.distributed.fsdp.share_comm_ctx`: PyTorch's function (shares streams).
    """
    states = _states_of(modules)
    if not states:
        raise ValueError("share_comm_ctx needs at least one fully_shard module, got []")
    shared = states[0].ctx.comm
    for state in states[1:]:
        state.ctx.comm = shared
