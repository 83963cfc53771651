"""``fully_shard``, the ``FSDPModule`` mix-in and ``UnshardHandle``.

See Also:
    ``torch.distributed.fsdp.fully_shard``: PyTorch's FSDP2 API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, cast, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hp_dtensor.device import (
    DEVICE_TYPE_CPU,
    get_device,
    get_device_type,
    is_accelerator,
    pin_memory_available,
)
from hp_fsdp.mesh_info import mesh_info_from_mesh
from hp_fsdp.param import MANAGED_FLAG as _MANAGED_FLAG
from hp_fsdp.param_group import ParamGroup, resolve_reshard_after_forward
from hp_fsdp.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    to_mp_policy,
    to_offload_policy,
)
from hp_fsdp.state import FSDPState, get_state

__all__ = ["FSDPModule", "HSDPModule", "UnshardHandle", "fully_shard"]

_CLS_TO_FSDP_CLS: dict[type, type] = {}


class UnshardHandle:
    """A handle on an :meth:`FSDPModule.unshard` issued with ``async_op=True``.

    See Also:
        ``torch.distributed.fsdp.UnshardHandle``: PyTorch's handle.
    """

    def __init__(self, groups: list[ParamGroup] | None = None) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gather; afterwards the unsharded parameters are registered.

        See Also:
            ``torch.distributed.fsdp.UnshardHandle.wait``: PyTorch's method.
        """
        if self._groups is not None:
            for group in self._groups:
                group.wait_for_unshard()
            self._groups = None


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(
        "a fully_shard module cannot be deep-copied; copy the model before fully_shard, or "
        "use its state dict"
    )


class FSDPModule:
    """Mix-in class of every module ``fully_shard`` was applied to (``FSDP<Original>``).

    ``fully_shard`` swaps a module's class for a class deriving from this one and from the
    original class, so ``isinstance(m, FSDPModule)`` identifies units. ``HSDPModule`` is the
    same class under HyperParallel's name.

    See Also:
        ``torch.distributed.fsdp.FSDPModule``: PyTorch's mix-in (same methods).
    """

    _orig_cls_mro_index: int = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        state = get_state(cast(nn.Module, self))
        if state is None:
            raise RuntimeError(f"no hp_fsdp state on {type(self).__name__}")
        return state

    def _units(self, recurse: bool) -> list[FSDPState]:
        module = cast(nn.Module, self)
        modules = list(module.modules()) if recurse else [module]
        states: list[FSDPState] = []
        for sub in modules:
            state = get_state(sub)
            if state is not None and state not in states:
                states.append(state)
        return states

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive).

        See Also:
            ``torch.distributed.fsdp.FSDPModule.reshard``: PyTorch's method.
        """
        group = self._get_fsdp_state().group
        if group is not None:
            group.to_sharded()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters and register the unsharded ones (not recursive).

        Args:
            async_op: return an :class:`UnshardHandle` to wait on instead of waiting here.

        Returns:
            The handle when ``async_op`` is True, else None.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.unshard``: PyTorch's method.
        """
        state = self._get_fsdp_state()
        group = state.group
        groups: list[ParamGroup] = []
        if group is not None:
            group.lazy_init(state.ctx if state.is_root is not None else None)
            group.unshard(async_op)
            groups.append(group)
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Set whether the next backward ends the iteration (waits for every reduction).

        Args:
            is_last_backward: False for all but the last micro-batch's backward.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_is_last_backward``: PyTorch's method.
        """
        self._get_fsdp_state().ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Set whether backward reduces gradients (False: accumulate unsharded gradients).

        Args:
            requires_gradient_sync: reduce gradients in the next backward.
            recurse: apply to every unit under this module.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_requires_gradient_sync``.
        """
        for state in self._units(recurse):
            if state.group is not None:
                state.group.reduce_grads = requires_gradient_sync
                state.group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Set whether HSDP all-reduces gradients over the replicate axis (False: accumulate).

        Args:
            requires_all_reduce: all-reduce in the next backward.
            recurse: apply to every unit under this module.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_requires_all_reduce``.
        """
        for state in self._units(recurse):
            if state.group is not None:
                state.group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Set whether parameters are resharded after forward.

        Args:
            reshard_after_forward: reshard after forward.
            recurse: apply to every unit under this module.

        Raises:
            ValueError: when ``reshard_after_forward`` is not a bool.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_reshard_after_forward``.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}"
            )
        for state in self._units(recurse):
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward
                state.group.post_forward_info = None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Set whether parameters are resharded after backward.

        Args:
            reshard_after_backward: reshard after backward.
            recurse: apply to every unit under this module.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_reshard_after_backward``.
        """
        for state in self._units(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Prefetch these units' all-gathers right after this unit's in forward.

        Args:
            modules: units to prefetch, in order.

        Raises:
            TypeError: when an entry is not a fully_shard module.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_modules_to_forward_prefetch``.
        """
        self._get_fsdp_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Prefetch these units' all-gathers right after this unit's in backward.

        Args:
            modules: units to prefetch, in order.

        Raises:
            TypeError: when an entry is not a fully_shard module.

        See Also:
            ``torch.distributed.fsdp.FSDPModule.set_modules_to_backward_prefetch``.
        """
        self._get_fsdp_state().backward_prefetch = _states_of(modules)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        group = self._get_fsdp_state().group
        if group is not None:
            with torch.no_grad():
                for param in group.params:
                    param.reset_sharded_param()
        return result


HSDPModule = FSDPModule
"""HyperParallel's name for :class:`FSDPModule` (the same class)."""


def _states_of(modules: Iterable[Any]) -> list[FSDPState]:
    states: list[FSDPState] = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise TypeError(
                f"expected modules that hp_fsdp.fully_shard was applied to, got "
                f"{type(module).__name__}"
            )
        states.append(state)
    return states


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard(mesh=None) needs an initialized default process group "
            "(torch.distributed.init_process_group or hp_dtensor.device.init_process_group)"
        )
    return init_device_mesh(get_device_type(), (dist.get_world_size(),))


def _managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
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


def _managed_params(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    seen_params: set[nn.Parameter] = set()
    seen_buffers: set[torch.Tensor] = set()
    for module in modules:
        for param in module.parameters(recurse=False):
            if param in ignored or param in seen_params:
                continue
            if getattr(param, _MANAGED_FLAG, False):
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


def _move_to_device(tensors: Iterable[torch.Tensor], device: torch.device) -> None:
    for tensor in tensors:
        if tensor.device == device or tensor.is_meta:
            continue
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"a DTensor parameter on {tensor.device} cannot be moved to {device} by "
                "fully_shard; move the model first"
            )
        tensor.data = tensor.to(device)


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLS_TO_FSDP_CLS.get(cls)
    if new_cls is None:
        new_cls = type(
            f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _unimplemented_deepcopy}
        )
        _CLS_TO_FSDP_CLS[cls] = new_cls
    module.__class__ = new_cls


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any | None = None,
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
    DTensor parameters of a tensor-parallel (1-D) mesh are sharded through their local tensors,
    with torch's placements on the concatenated (dp, tp) mesh (``_StridedShard`` where the
    tensor-parallel placement shards the same dim).

    Args:
        module: a module, or a list of modules forming one unit.
        mesh: the 1-D or 2-D data-parallel mesh; None means all ranks of the default group.
        reshard_after_forward: True (free after forward), False (keep), None (True except for
            the root), or an int k: keep a 1/k share after forward, gathered within groups of k
            ranks in backward (k must divide the shard size; 1 means False).
        shard_placement_fn: maps a parameter to ``Shard(dim)`` (None: ``Shard(0)``).
        mp_policy: the mixed-precision policy (ours or PyTorch's).
        offload_policy: the offload policy (ours or PyTorch's).
        ignored_params: parameters left alone (not sharded, not reduced).
        dp_mesh_dims: PyTorch's SPMD-mesh option; not supported by this runtime yet (raises).

    Returns:
        The module (or list), with its class swapped to ``FSDP<Original>``.

    Raises:
        ValueError: for a bad mesh, ``reshard_after_forward`` or policy, or pinned memory
            without an accelerator.
        TypeError: for a non-module argument or unknown policy type.
        NotImplementedError: for ``dp_mesh_dims``, DTensor parameters on a mesh of more than
            one dim, or an int ``reshard_after_forward`` with DTensor parameters.

    See Also:
        ``torch.distributed.fsdp.fully_shard``: PyTorch's FSDP2 API.
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "hp_fsdp.fully_shard does not support dp_mesh_dims yet; pass the data-parallel "
            "(sub)mesh as mesh instead"
        )
    if isinstance(module, nn.Module):
        roots: tuple[nn.Module, ...] = (module,)
    elif isinstance(module, list) and module and all(isinstance(m, nn.Module) for m in module):
        roots = _root_modules(module)
    else:
        raise TypeError(
            f"fully_shard expects an nn.Module or a non-empty list of them, got {module!r}"
        )
    for root in roots:
        if isinstance(root, nn.ModuleList | nn.ModuleDict) and (
            type(root).forward is nn.Module.forward
        ):
            raise ValueError(
                f"fully_shard cannot wrap a {type(root).__name__} without a forward; wrap its "
                "children or the parent module"
            )
        if get_state(root) is not None:
            raise ValueError(f"fully_shard was already applied to {type(root).__name__}")
    mp = to_mp_policy(mp_policy)
    offload = to_offload_policy(offload_policy)
    if isinstance(offload, CPUOffloadPolicy) and offload.pin_memory and not pin_memory_available():
        raise ValueError(
            "CPUOffloadPolicy(pin_memory=True) needs an accelerator for pinned host memory; "
            "on a CPU-only machine use CPUOffloadPolicy(pin_memory=False)"
        )
    if mesh is None:
        mesh = _default_mesh()
    mesh_info = mesh_info_from_mesh(mesh)
    device = get_device() if is_accelerator(mesh.device_type) else torch.device(DEVICE_TYPE_CPU)
    auto = reshard_after_forward is None
    resolved = resolve_reshard_after_forward(
        True if reshard_after_forward is None else reshard_after_forward, mesh_info.shard_size
    )
    managed = _managed_modules(roots)
    params, buffers = _managed_params(managed, set(ignored_params or ()))
    _move_to_device([*params, *buffers], device)
    state = FSDPState(roots, device, mp, auto)
    if params:
        dims: list[int] = []
        for param in params:
            placement = shard_placement_fn(param) if shard_placement_fn is not None else None
            if placement is None:
                dims.append(0)
            elif isinstance(placement, Shard):
                dims.append(placement.dim)
            else:
                raise TypeError(
                    "shard_placement_fn must return Shard(dim) or None, got "
                    f"{type(placement).__name__}"
                )
        state.group = ParamGroup(params, roots, mesh_info, device, resolved, dims, mp, offload)
    for root in roots:
        _swap_class(root)
    if isinstance(module, nn.Module):
        return cast(FSDPModule, module)
    return [cast(FSDPModule, m) for m in module]


def _root_modules(modules: list[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules of ``modules`` that are not submodules of another one in the list."""
    candidates = list(dict.fromkeys(modules))
    nested: set[nn.Module] = set()
    for module in candidates:
        for sub in module.modules():
            if sub is not module:
                nested.add(sub)
    return tuple(m for m in candidates if m not in nested)
