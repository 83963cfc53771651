"""One sharded parameter: its sharded DTensor, padded local storage and unsharded view.

Tensors of one parameter:

- the *padded shard*: a flat tensor holding this rank's ``torch.chunk`` piece of the parameter
  along the shard dim, zero-padded to the size of chunk 0 (the largest); it is what goes into
  the all-gather;
- the *sharded parameter*: an ``nn.Parameter`` holding a DTensor whose local tensor is the
  unpadded view of the padded shard, with torch's placements (``Shard(d)``, or
  ``(Replicate(), Shard(d))`` for HSDP); it is registered on the module while sharded and is
  what the optimizer updates;
- the *unsharded data*: a flat tensor in the compute dtype holding the gathered padded
  parameter; its storage is freed (resized to 0) on reshard and reallocated before the next
  all-gather, so autograd's saved views of it stay valid;
- the *unsharded parameter*: an ``nn.Parameter`` viewing the unsharded data with the original
  shape, created once, registered on the module while unsharded.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam`: PyTorch's counterpart.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from hp_fsdp._torch_compat import (
    AsyncCollectiveTensor,
    DTensorSpec,
    StridedShard,
    TensorMeta,
    concatenate_meshes,
)
from hp_fsdp.errors import FSDPUnsupportedParamError, FSDPUsageError
from hp_fsdp.extension import AllGatherExtension
from hp_fsdp.mesh_info import MeshInfo, _dim_names

__all__ = [
    "MANAGED_FLAG",
    "MODE_ATTR",
    "ParamModuleInfo",
    "ParamOrigin",
    "ShardedParam",
    "ShardedState",
    "register_sharded",
    "register_unsharded",
    "unsharded_outs",
]

#: Attribute set on an original parameter (and its sharded replacement) once a unit owns it.
MANAGED_FLAG = "_hp_fsdp_managed"
#: Attribute on a managed sharded parameter naming its data-parallel mode (see ``mode``).
MODE_ATTR = "_hp_fsdp_mode"


class ShardedState(enum.Enum):
    """Which tensor of a parameter is registered on its module.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.ShardedState`: PyTorch's enum.
    """

    SHARDED = enum.auto()
    SHARDED_POST_FORWARD = enum.auto()
    UNSHARDED = enum.auto()


class ParamOrigin:
    """Identity token of an original parameter (set on it under :data:`MANAGED_FLAG`)."""


@dataclass
class ParamModuleInfo:
    """Where a parameter is registered: its module and name, plus any tied registrations.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.ParamModuleInfo`: PyTorch's class.
    """

    module: nn.Module
    name: str
    shared: list[tuple[nn.Module, str]] = field(default_factory=list)


def _make_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """Wrap a local tensor as a DTensor without checks or autograd (torch's fast path)."""
    return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` with its tensor metadata in another dtype."""
    meta = spec.tensor_meta
    if meta is None or meta.dtype == dtype:
        return spec
    return DTensorSpec(
        spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype)
    )


def _contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    strides: list[int] = []
    running = 1
    for dim in reversed(size):
        strides.append(running)
        running *= max(dim, 1)
    return tuple(reversed(strides))


#: Per module class: whether its ``__setattr__`` is ``nn.Module``'s (a cache keyed by class).
_PLAIN_SETATTR: dict[type, bool] = {}


def _plain_setattr(cls: type) -> bool:
    """Whether ``cls.__setattr__`` is ``nn.Module``'s, so a parameter can go straight into
    ``_parameters`` (asked once per class)."""
    plain = _PLAIN_SETATTR.get(cls)
    if plain is None:
        method = cls.__setattr__
        plain = _PLAIN_SETATTR[cls] = getattr(method, "__func__", method) is nn.Module.__setattr__
    return plain


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _spmd_sharded_layout(
    spmd_mesh: DeviceMesh, mesh_info: MeshInfo, placements: tuple[Placement, ...]
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a sharded parameter on a full SPMD mesh (``dp_mesh_dims``).

    With one shard dim this is the SPMD mesh itself. Several shard dims (e.g. dp_shard and cp)
    are one flattened axis of the sharded DTensor, at the first shard dim's position (after
    the replicate axis for HSDP, whose own dims are then left out), as in PyTorch.
    """
    assert mesh_info.dp_mesh_dims is not None
    names = spmd_mesh.mesh_dim_names or ()
    shard_names = _dim_names(mesh_info.dp_mesh_dims.shard)
    if len(shard_names) <= 1:
        return spmd_mesh, placements
    replicate_names = set(_dim_names(mesh_info.dp_mesh_dims.replicate))
    meshes: list[DeviceMesh] = []
    layout: list[Placement] = []
    for i, name in enumerate(names):
        if name in shard_names:
            if name != next(n for n in names if n in shard_names):
                continue  # a later shard dim: part of the flattened axis
            meshes.append(mesh_info.mesh)
            if mesh_info.is_hsdp:
                layout.append(Replicate())
            layout.append(placements[i])
        elif name in replicate_names and mesh_info.is_hsdp:
            continue  # the replicate axis sits before the flattened shard axis
        else:
            meshes.append(spmd_mesh[name])
            layout.append(placements[i])
    return concatenate_meshes(meshes), tuple(layout)


def _shard_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the shard axis (the last dim; HSDP's replicate axis left out)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise FSDPUsageError(f"a {mesh.ndim}-D FSDP mesh needs mesh_dim_names, got none")
    return mesh[names[-1]]


class ShardedParam:
    """State of one parameter managed by ``fully_shard``.

    Args:
        param: the original parameter (on the mesh's device or on the meta device).
        module_info: where the parameter is registered.
        mesh_info: the data-parallel mesh.
        device: the compute device.
        shard_dim: the dim to shard (``Shard(shard_dim)``).
        offload_to_cpu: keep the padded shard (and gradients) in host memory.
        pin_memory: pin that host memory.

    Raises:
        ValueError: for a scalar parameter, a non-contiguous one, or an uneven split of a
            non-zero shard dim.
        NotImplementedError: for a DTensor parameter (FSDP over tensor parallelism) on an
            unsupported mesh, or a tensor subclass implementing ``fsdp_pre_all_gather`` with
            ``dp_mesh_dims``, replicated over a 2-D mesh, or unevenly sharded on an inner dim
            (PyTorch's message).
        FSDPUsageError: (an ``AssertionError``, as in PyTorch) for a tensor subclass defining
            only one of ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam`: PyTorch's class.
    """

    def __init__(
        self,
        param: nn.Parameter,
        module_info: ParamModuleInfo,
        mesh_info: MeshInfo,
        device: torch.device,
        shard_dim: int,
        offload_to_cpu: bool,
        pin_memory: bool,
    ) -> None:
        # FSDP over tensor parallelism: a DTensor parameter is sharded through its local tensor.
        self._tp_spec: DTensorSpec | None = None
        data: torch.Tensor = param
        spmd_mesh = mesh_info.spmd_mesh
        self._dp_dim_indices: frozenset[int] = frozenset()
        if spmd_mesh is not None and not (
            isinstance(param, DTensor) and param.device_mesh == spmd_mesh
        ):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
                f"mesh passed to fully_shard, got {module_info.name!r} as {type(param).__name__}"
                + (f" on {param.device_mesh}" if isinstance(param, DTensor) else "")
            )
        if isinstance(param, DTensor):
            self._tp_spec = param._spec
            if spmd_mesh is None and self._tp_spec.mesh.ndim > 2:
                raise NotImplementedError(
                    "fully_shard supports DTensor parameters on a 1-D (TP or EP) or 2-D (EP x TP) "
                    f"mesh, as PyTorch; got {module_info.name!r} on a "
                    f"{self._tp_spec.mesh.ndim}-D mesh (pass the full mesh with dp_mesh_dims)"
                )
            if self._tp_spec.mesh.device_type != mesh_info.mesh.device_type:
                raise ValueError(
                    "Requires DTensor to have mesh of the same type as the FSDP mesh: the DTensor "
                    f"parameter {module_info.name!r} lives on a {self._tp_spec.mesh.device_type} "
                    f"mesh but fully_shard's mesh is {mesh_info.mesh.device_type}"
                )
            data = param._local_tensor
        if param.ndim == 0:
            raise ValueError(  # PyTorch's exact message (users match it)
                "fully_shard doesn't support scalar parameters. "
                f"Change {module_info.name} to a 1D tensor with numel equal to 1."
            )
        has_pre = hasattr(data, "fsdp_pre_all_gather")
        if has_pre != hasattr(data, "fsdp_post_all_gather"):
            raise FSDPUsageError(
                "the fsdp_pre_all_gather/fsdp_post_all_gather extension needs both methods: "
                f"{module_info.name!r} is a {type(data).__name__} defining only one"
            )
        #: The all-gather extension (``fsdp_pre_all_gather``/``fsdp_post_all_gather``).
        self.extension: AllGatherExtension | None = None
        if has_pre:
            if spmd_mesh is not None or (mesh_info.replicate_only and mesh_info.mesh.ndim > 1):
                raise NotImplementedError(
                    "fully_shard supports the fsdp_pre_all_gather/fsdp_post_all_gather "
                    "extension for parameters sharded by FSDP or HSDP (plain, or DTensors on "
                    "their own TP/EP mesh) or replicated over a 1-D mesh; got "
                    f"{module_info.name!r} "
                    + (
                        "with dp_mesh_dims"
                        if spmd_mesh is not None
                        else f"replicated over a {mesh_info.mesh.ndim}-D mesh"
                    )
                )
            dim = shard_dim + data.ndim if shard_dim < 0 else shard_dim
            if 0 < dim < data.ndim and data.size(dim) % mesh_info.shard_size != 0:
                # The subclass's all-gather inputs cannot be padded on an inner dim (PyTorch
                # refuses every uneven inner-dim shard; hp-fsdp only this one).
                raise NotImplementedError(
                    f"FSDP does not support uneven sharding on dim {dim}: {tuple(data.size())} "
                    f"(world size: {mesh_info.shard_size}) for the fsdp_pre_all_gather tensor "
                    f"subclass {module_info.name!r}"
                )
            self.extension = AllGatherExtension(_shard_submesh(mesh_info.mesh))
        if not data.is_contiguous():
            raise FSDPUnsupportedParamError(
                "FSDP does not support non-contiguous parameters yet: fully_shard needs "
                f"contiguous parameters, got {module_info.name!r} with shape "
                f"{tuple(param.shape)} and stride {param.stride()}"
            )
        if shard_dim < 0:
            shard_dim += data.ndim
        if not 0 <= shard_dim < data.ndim:
            raise FSDPUsageError(
                f"Shard dim {shard_dim} is invalid for {data.ndim}D tensor: the shard dim is out "
                f"of range for the parameter {module_info.name!r} of shape {tuple(param.shape)}"
            )
        self.module_info = module_info
        self.mesh_info = mesh_info
        self.device = device
        self.shard_dim = shard_dim
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory
        dp_placement: Placement = Shard(shard_dim)
        spec_mesh = mesh_info.mesh
        tp_placements: tuple[Placement, ...] = ()
        if self._tp_spec is not None and spmd_mesh is None:
            split_factor = self._tp_spec.num_shards_map[shard_dim]
            if split_factor > 1:
                dp_placement = StridedShard(shard_dim, split_factor=split_factor)
            tp_placements = tuple(self._tp_spec.placements)
            spec_mesh = concatenate_meshes([mesh_info.mesh, self._tp_spec.mesh])
        if spmd_mesh is not None and self._tp_spec is not None:
            spec_mesh, self.placements = _spmd_sharded_layout(
                spmd_mesh, mesh_info, self._spmd_placements(spmd_mesh, mesh_info, shard_dim)
            )
        elif mesh_info.replicate_only:
            if self._tp_spec is not None:
                raise NotImplementedError(
                    f"replicate does not support DTensor parameters yet, got {module_info.name!r}"
                )
            self.placements = (Replicate(),) * mesh_info.mesh.ndim
        elif mesh_info.is_hsdp:
            self.placements = (Replicate(), dp_placement, *tp_placements)
        else:
            self.placements = (dp_placement, *tp_placements)
        self.orig_size = data.size()
        self.orig_stride = _contiguous_strides(self.orig_size)
        ws, rank = mesh_info.shard_size, mesh_info.shard_rank
        meta = (
            self._tp_spec.tensor_meta
            if self._tp_spec is not None
            else TensorMeta(param.size(), param.stride(), param.dtype)
        )
        self._spec = DTensorSpec(spec_mesh, self.placements, tensor_meta=meta)
        # torch.chunk semantics: chunk 0 is the largest; trailing ranks may get nothing.
        dim_size = data.size(shard_dim)
        chunk = -(-dim_size // ws) if dim_size > 0 else 0
        start = min(chunk * rank, dim_size)
        length = max(min(chunk, dim_size - start), 0)
        padded_size = list(self.orig_size)
        padded_size[shard_dim] = chunk
        self.padded_sharded_size = torch.Size(padded_size)
        sharded_size = list(self.orig_size)
        sharded_size[shard_dim] = length
        self.sharded_size = torch.Size(sharded_size)
        self.sharded_stride = _contiguous_strides(self.sharded_size)
        self.padded_sharded_numel = self.padded_sharded_size.numel()
        with torch.no_grad():
            padded = data.detach().new_zeros(self.padded_sharded_size)
            if length > 0:
                padded.narrow(shard_dim, 0, length).copy_(
                    data.detach().narrow(shard_dim, start, length)
                )
            if offload_to_cpu and not padded.is_meta:
                padded = padded.cpu()
                if pin_memory:
                    padded = padded.pin_memory()
        self._padded_shard = padded.view(-1)
        local = padded.narrow(shard_dim, 0, length)
        self.sharded_param = nn.Parameter(
            _make_dtensor(local, self._spec, param.requires_grad),
            requires_grad=param.requires_grad,
        )
        existing = getattr(param, MANAGED_FLAG, None)
        #: Shared by every ShardedParam made from one original parameter (tied ones in two
        #: units), so lazy initialization can name the duplicate as PyTorch does.
        self.origin = existing if isinstance(existing, ParamOrigin) else ParamOrigin()
        setattr(param, MANAGED_FLAG, self.origin)
        self._mark(self.sharded_param)
        #: Every (module, name) the parameter is registered under (first, then tied ones).
        self._registrations: tuple[tuple[nn.Module, str], ...] = (
            (module_info.module, module_info.name),
            *module_info.shared,
        )
        self._set_on_modules(self.sharded_param)
        self.state = ShardedState.SHARDED
        self.orig_dtype: torch.dtype = param.dtype
        self.param_dtype: torch.dtype | None = None
        #: The dtype of the unsharded parameter (``param_dtype`` or ``orig_dtype``; an
        #: attribute, not a property: the hot path reads it per parameter and step).
        self.compute_dtype: torch.dtype = param.dtype
        self.reduce_dtype: torch.dtype | None = None
        self._unsharded_data: torch.Tensor | None = None
        self._unsharded_param: nn.Parameter | None = None
        self._post_forward_data: torch.Tensor | None = None
        #: The unit's mixed-precision policy (passed to ``fsdp_pre_all_gather``).
        self.mp_policy: object = None
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        self.fqn: str = module_info.name

    @property
    def mode(self) -> str:
        """How the parameter is data-parallel: ``"fsdp"``, ``"hsdp"`` or ``"ddp"`` (kept whole)."""
        if self.mesh_info.replicate_only:
            return "ddp"
        return "hsdp" if self.mesh_info.is_hsdp else "fsdp"

    def _mark(self, sharded: nn.Parameter) -> None:
        """Tag a registered sharded parameter as managed (and with its mode) for helpers."""
        setattr(sharded, MANAGED_FLAG, True)
        setattr(sharded, MODE_ATTR, self.mode)

    def _spmd_placements(
        self, spmd_mesh: DeviceMesh, mesh_info: MeshInfo, shard_dim: int
    ) -> tuple[Placement, ...]:
        """The sharded placements on the full SPMD mesh (``dp_mesh_dims``).

        The DP shard dim gets ``Shard(shard_dim)`` (strided when later mesh dims shard the
        same tensor dim); the other dims keep their placements. The DP dims must be Replicate.
        """
        assert self._tp_spec is not None
        assert mesh_info.dp_mesh_dims is not None
        names = spmd_mesh.mesh_dim_names or ()
        dims = mesh_info.dp_mesh_dims
        shard_names = _dim_names(dims.shard)
        dp_names = (*shard_names, *_dim_names(dims.replicate))
        orig = tuple(self._tp_spec.placements)
        for name in dp_names:
            if not isinstance(orig[names.index(name)], Replicate):
                raise ValueError(
                    f"with dp_mesh_dims the parameter {self.module_info.name!r} must be "
                    f"Replicate() on the data-parallel dim {name!r}, got {orig[names.index(name)]}"
                )
        self._dp_dim_indices = frozenset(names.index(n) for n in dp_names)
        placements = list(orig)
        for name in shard_names:
            idx = names.index(name)
            split_factor = 1
            for j in range(idx + 1, spmd_mesh.ndim):
                p = orig[j]
                if isinstance(p, Shard | StridedShard) and p.dim == shard_dim:
                    split_factor *= spmd_mesh.size(j)
            placements[idx] = (
                StridedShard(shard_dim, split_factor=split_factor)
                if split_factor > 1
                else Shard(shard_dim)
            )
        return tuple(placements)

    # ----------------------------------------------------------------- setup
    def init_dtypes(
        self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
    ) -> None:
        """Resolve the compute and reduce dtypes (None where no cast is needed).

        Args:
            param_dtype: the policy's ``param_dtype``.
            reduce_dtype: the policy's ``reduce_dtype``.
        """
        self.orig_dtype = self.sharded_param.dtype
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.compute_dtype = param_dtype or self.orig_dtype

    def reset_sharded_param(self) -> None:
        """Re-adopt the registered sharded parameter after ``to_empty``/``_apply``/loading.

        When the DTensor's local tensor is no longer a view of the padded shard (materialization
        from the meta device, ``module.to``, ``load_state_dict(assign=True)``), its values are
        copied into fresh padded storage and the local tensor becomes a view of it again.
        """
        info = self.module_info
        current = info.module._parameters.get(info.name)
        if isinstance(current, nn.Parameter) and current is not self.sharded_param:
            if not isinstance(current, DTensor):
                raise TypeError(
                    f"parameter {self.fqn!r} was replaced by a non-DTensor while sharded by "
                    "fully_shard; assign a DTensor with the same placements instead"
                )
            self.sharded_param = current
            self._mark(current)
        sharded = cast(DTensor, self.sharded_param)
        local = sharded._local_tensor
        if local.is_meta:
            return
        if self.extension is not None:
            # The extension's subclass gathers from its local tensor; the padded shard is unused.
            self._spec = sharded._spec
            return
        padded = self._padded_shard
        same_storage = (
            not padded.is_meta
            and padded.untyped_storage().data_ptr() != 0
            and padded.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        )
        if same_storage and local.size() == self.sharded_size:
            return
        length = self.sharded_size[self.shard_dim]
        with torch.no_grad():
            new_padded = local.new_zeros(self.padded_sharded_size)
            if length > 0:
                new_padded.narrow(self.shard_dim, 0, length).copy_(local)
            if self.pin_memory and not new_padded.is_pinned():
                new_padded = new_padded.pin_memory()
        self._padded_shard = new_padded.view(-1)
        sharded._local_tensor = new_padded.narrow(self.shard_dim, 0, length)
        self._spec = sharded._spec

    # ----------------------------------------------------------------- all-gather
    def all_gather_input(self) -> torch.Tensor:
        """The flat tensor this rank contributes to the all-gather (original dtype)."""
        if self.state == ShardedState.SHARDED_POST_FORWARD:
            assert self._post_forward_data is not None
            return self._post_forward_data
        data = self._padded_shard
        if self.offload_to_cpu and data.device != self.device:
            data = data.to(self.device, non_blocking=True)
        return data

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """The flat tensors this rank contributes: the extension's inputs, else the shard."""
        ext = self.extension
        if ext is None:
            if self.state is ShardedState.SHARDED and not self.offload_to_cpu:
                return [self._padded_shard]
            return [self.all_gather_input()]
        local = cast(DTensor, self.sharded_param)._local_tensor
        if self.offload_to_cpu and local.device != self.device:
            local = local.to(self.device, non_blocking=True)
        return ext.inputs(
            local,
            self.orig_size,
            self.orig_stride,
            self.module_info.module,
            self.mp_policy,
            self.padded_sharded_size,
        )

    def all_gather_outputs(self, inputs: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """The flat buffers the all-gather of ``inputs`` is copied into (allocated).

        Args:
            inputs: what :meth:`all_gather_inputs` returned for this all-gather.
            world_size: the all-gather world size.

        Returns:
            One buffer per input.
        """
        ext = self.extension
        if ext is None:
            return [self.unsharded_out(world_size)]
        return ext.outputs(
            [t.numel() for t in inputs], [t.dtype for t in inputs], world_size, self.device
        )

    def unsharded_out(self, world_size: int) -> torch.Tensor:
        """The flat compute-dtype buffer the all-gather output is copied into (allocated).

        Args:
            world_size: the all-gather world size (to size the buffer on first use).

        Returns:
            The flat buffer, with storage allocated.
        """
        return unsharded_outs((self,))[0]

    def init_unsharded_param(self) -> None:
        """Create the unsharded parameter (once) as a view of the unsharded data."""
        ext = self.extension
        if ext is not None:
            local = cast(DTensor, self.sharded_param)._local_tensor
            with torch.no_grad():
                unsharded = ext.unsharded(local, self.compute_dtype, self._unsharded_param)
            if unsharded is not None:
                view = torch.as_strided(unsharded, self.orig_size, self.orig_stride, 0)
                if self._tp_spec is not None:
                    view = _make_dtensor(view, _with_dtype(self._tp_spec, view.dtype), False)
                self._unsharded_param = nn.Parameter(
                    view, requires_grad=self.sharded_param.requires_grad
                )
            return
        if self._unsharded_param is not None:
            return
        assert self._unsharded_data is not None
        view = torch.as_strided(self._unsharded_data, self.orig_size, self.orig_stride, 0)
        tp_spec = self._tp_spec
        if tp_spec is not None:
            view = _make_dtensor(view, _with_dtype(tp_spec, view.dtype), False)
        self._unsharded_param = nn.Parameter(view, requires_grad=self.sharded_param.requires_grad)

    @property
    def unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter (raises before the first unshard)."""
        if self._unsharded_param is None:
            raise RuntimeError(f"parameter {self.fqn!r} has not been unsharded yet")
        return self._unsharded_param

    @property
    def has_unsharded_param(self) -> bool:
        """Whether the unsharded parameter exists (after the first unshard)."""
        return self._unsharded_param is not None

    @property
    def unsharded_data(self) -> torch.Tensor | None:
        """The flat unsharded buffer (None before the first unshard)."""
        return self._unsharded_data

    # ----------------------------------------------------------------- transitions
    def _set_on_modules(self, param: nn.Parameter) -> None:
        for module, name in self._registrations:
            if _PLAIN_SETATTR.get(type(module)) or _plain_setattr(type(module)):
                module._parameters[name] = param
            else:
                setattr(module, name, param)

    def to_sharded(self) -> None:
        """Register the sharded parameter and free the unsharded storage."""
        register_sharded((self,))

    def to_sharded_post_forward(self, sub_size: int, sub_rank: int) -> None:
        """Keep only this rank's 1/``sub_size`` piece of the unsharded data, free the rest.

        Args:
            sub_size: the size ``k`` of the post-forward group.
            sub_rank: this rank's index in it.
        """
        if self.extension is not None:
            raise NotImplementedError(
                "an int reshard_after_forward is not supported for the "
                f"fsdp_pre_all_gather extension (parameter {self.fqn!r}), as in PyTorch"
            )
        assert self._unsharded_data is not None
        numel = self._unsharded_data.numel() // sub_size
        self._post_forward_data = self._unsharded_data.narrow(0, numel * sub_rank, numel).clone()
        self._set_on_modules(self.sharded_param)
        self.free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (its data must have been gathered)."""
        param = self.unsharded_param
        requires_grad = self.sharded_param.requires_grad
        if param.requires_grad != requires_grad:
            param.requires_grad_(requires_grad)
        self._set_on_modules(param)
        self._post_forward_data = None
        self.state = ShardedState.UNSHARDED

    def init_and_register_unsharded(self) -> None:
        """:meth:`init_unsharded_param` then :meth:`to_unsharded` (one call on the hot path)."""
        register_unsharded((self,))

    def free_unsharded(self) -> None:
        """Free the storage of the unsharded data (the tensor objects stay)."""
        if self.extension is not None:
            self.extension.free()
        if self._unsharded_data is not None:
            _free_storage(self._unsharded_data)

    # ----------------------------------------------------------------- gradients
    def accumulate_unsharded_grad_if_needed(self) -> None:
        """Add the new unsharded gradient into the reduce-dtype accumulator, if one exists."""
        param = self._unsharded_param
        acc = self.unsharded_accumulated_grad
        if acc is not None and param is not None and param.grad is not None:
            acc += param.grad
            param.grad = None

    def to_accumulated_grad_if_needed(self) -> None:
        """Move an unsharded gradient into a reduce-dtype accumulator (mixed precision)."""
        param = self._unsharded_param
        if self.reduce_dtype is None or param is None or param.grad is None:
            return
        if param.grad.dtype == self.reduce_dtype:
            return
        grad = param.grad
        param.grad = None
        self.unsharded_accumulated_grad = grad.to(self.reduce_dtype)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Remove and return the (local) gradient to reduce, accumulated or fresh, or None."""
        if self.unsharded_accumulated_grad is not None:
            grad = self.unsharded_accumulated_grad
            self.unsharded_accumulated_grad = None
            return self._local_grad(grad)
        param = self._unsharded_param
        if param is None or param.grad is None:
            return None
        grad = param.grad
        param.grad = None
        return grad if self._tp_spec is None else self._local_grad(grad)

    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a tensor-parallel gradient in the parameter's placements."""
        tp_spec = self._tp_spec
        if tp_spec is None:
            return grad
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"the gradient of the tensor-parallel parameter {self.fqn!r} must be a DTensor, "
                f"got {type(grad).__name__}"
            )
        placements = tuple(grad.placements)
        if self._dp_dim_indices:  # dp_mesh_dims: the data-parallel dims keep their placements
            target = tuple(
                placements[i] if i in self._dp_dim_indices else p
                for i, p in enumerate(tp_spec.placements)
            )
        else:
            target = tuple(tp_spec.placements)
        if placements != target:
            grad = grad.redistribute(placements=target)
        local = grad._local_tensor
        if isinstance(local, AsyncCollectiveTensor):  # a redistribution still in flight
            local = local.wait()
        return local

    def chunk_length(self, rank: int) -> int:
        """How many entries of the shard dim ``rank`` holds (``torch.chunk`` semantics)."""
        dim_size = self.orig_size[self.shard_dim]
        chunk = self.padded_sharded_size[self.shard_dim]
        return max(min(chunk, dim_size - chunk * rank), 0)

    def reduce_scatter_layout(self, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The gradient and shard dim to pack for the reduce-scatter.

        An uneven split of a shard dim other than 0 is padded to equal chunks and the chunks
        stacked on dim 0, so row ``r`` of the packed buffer is rank ``r``'s padded chunk.

        Args:
            grad: the unsharded (local) gradient.

        Returns:
            ``(tensor, shard_dim)`` for ``reduce_scatter_copy_in``.
        """
        dim = self.shard_dim
        if dim == 0 or grad.size(dim) % self.mesh_info.shard_size == 0:
            return grad, dim
        ws = self.mesh_info.shard_size
        padded_size = list(grad.shape)
        padded_size[dim] = self.padded_sharded_size[dim] * ws
        padded = grad.new_zeros(padded_size)
        padded.narrow(dim, 0, grad.size(dim)).copy_(grad)
        return torch.cat(padded.chunk(ws, dim), 0), 0

    def reduced_shard_view(self, output: torch.Tensor, offset: int) -> torch.Tensor:
        """This parameter's reduced gradient shard inside a flat reduce-scatter output.

        Args:
            output: the flat reduced output of the unit.
            offset: the element offset of this parameter's padded shard in it.

        Returns:
            A view of the sharded size.
        """
        start = output.storage_offset() + offset  # ``output`` may be a row of a larger buffer
        if self.shard_dim == 0 or self.padded_sharded_size == self.sharded_size:
            return torch.as_strided(
                output, self.sharded_size, self.sharded_stride, storage_offset=start
            )
        padded = torch.as_strided(
            output,
            self.padded_sharded_size,
            _contiguous_strides(self.padded_sharded_size),
            storage_offset=start,
        )
        return padded.narrow(self.shard_dim, 0, self.sharded_size[self.shard_dim])

    @property
    def is_tensor_parallel(self) -> bool:
        """Whether the parameter was a DTensor (FSDP over tensor parallelism)."""
        return self._tp_spec is not None

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a local tensor of the sharded size as a DTensor with this parameter's spec.

        Args:
            local: a tensor of size :attr:`sharded_size`.

        Returns:
            The DTensor (no autograd history).
        """
        spec = self._spec
        meta = spec.tensor_meta
        if meta is not None and meta.dtype != local.dtype:
            spec = _with_dtype(spec, local.dtype)
        return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]

    @property
    def padded_shard(self) -> torch.Tensor:
        """The flat padded local shard (what this rank contributes to the all-gather)."""
        return self._padded_shard

    @torch.no_grad()
    def rebase_padded_shard(self, buffer: torch.Tensor) -> None:
        """Move the padded shard into ``buffer`` (a flat slice of a unit-wide buffer).

        Args:
            buffer: a flat tensor of :attr:`padded_sharded_numel` elements.
        """
        buffer.copy_(self._padded_shard)
        self._padded_shard = buffer
        length = self.sharded_size[self.shard_dim]
        local = buffer.view(self.padded_sharded_size).narrow(self.shard_dim, 0, length)
        cast(DTensor, self.sharded_param)._local_tensor = local

    @torch.no_grad()
    def accumulate_main_grad(self, new_grad: torch.Tensor) -> None:
        """Add a reduced float32 shard into ``main_grad`` and refresh ``.grad`` from it.

        Args:
            new_grad: the reduced local gradient shard, float32.
        """
        sharded = self.sharded_param
        main = getattr(sharded, "main_grad", None)
        if isinstance(main, DTensor):
            main._local_tensor += new_grad
        else:
            main = self.to_sharded_dtensor(new_grad.clone())
            sharded.main_grad = main  # type: ignore[attr-defined]
        if sharded.dtype == main.dtype:
            sharded.grad = main
        else:
            sharded.grad = self.to_sharded_dtensor(main._local_tensor.to(sharded.dtype))

    def load_value(self, value: torch.Tensor) -> DTensor:
        """Turn a state-dict entry into a DTensor with this parameter's spec.

        Args:
            value: a DTensor (redistributed when its placements differ), a plain tensor of the
                global shape (this rank's shard is taken), or a plain tensor of this rank's
                local shard shape. When the global and local shapes coincide, the value is read
                as global.

        Returns:
            A DTensor of this parameter's dtype, device and placements.

        Raises:
            ValueError: for a plain tensor of neither shape.
        """
        spec = self._spec
        meta = spec.tensor_meta
        assert meta is not None
        global_shape = meta.shape
        dtype = self.sharded_param.dtype
        if isinstance(value, DTensor):
            if value.device_mesh == spec.mesh and tuple(value.placements) == self.placements:
                local = value._local_tensor
            else:
                value = value.full_tensor()
        if not isinstance(value, DTensor):
            if value.shape == global_shape:
                from torch.distributed.tensor import distribute_tensor

                device = value.device if self.sharded_param.is_meta else self.sharded_param.device
                full = value.detach().to(device=device, dtype=dtype)
                local = distribute_tensor(
                    full, spec.mesh, list(self.placements), src_data_rank=None
                )._local_tensor
            elif value.shape == self.sharded_size:
                local = value.detach()
            else:
                raise ValueError(
                    f"cannot load {self.fqn!r}: expected a DTensor, a tensor of the global shape "
                    f"{tuple(global_shape)} or of this rank's shard shape "
                    f"{tuple(self.sharded_size)}, got shape {tuple(value.shape)}"
                )
        # Loading into a meta-initialized model (assign=True) keeps the value's device.
        device = local.device if self.sharded_param.is_meta else self.sharded_param.device
        local = local.to(device=device, dtype=dtype)
        return self.to_sharded_dtensor(local)

    def readopt(self) -> None:
        """Re-adopt the registered sharded parameter and re-tie every registration."""
        self.reset_sharded_param()
        info = self.module_info
        self._registrations = ((info.module, info.name), *info.shared)
        self._set_on_modules(self.sharded_param)

    def __repr__(self) -> str:
        return f"ShardedParam(fqn={self.fqn!r}, size={tuple(self.orig_size)})"


def register_unsharded(params: Sequence[ShardedParam]) -> None:
    """:meth:`ShardedParam.init_unsharded_param` then :meth:`ShardedParam.to_unsharded` for
    each parameter (a unit's hot path: one Python call for the unit, not one per parameter).

    Args:
        params: the parameters, their data gathered.

    Raises:
        RuntimeError: for a parameter whose unsharded parameter could not be made.
    """
    for sp in params:
        if sp.extension is not None or sp._unsharded_param is None:
            sp.init_unsharded_param()
        param = sp._unsharded_param
        if param is None:
            raise RuntimeError(f"parameter {sp.fqn!r} has not been unsharded yet")
        requires_grad = sp.sharded_param.requires_grad
        if param.requires_grad != requires_grad:
            param.requires_grad_(requires_grad)
        for module, name in sp._registrations:  # _set_on_modules, inlined
            if _PLAIN_SETATTR.get(type(module)) or _plain_setattr(type(module)):
                module._parameters[name] = param
            else:
                setattr(module, name, param)
        sp._post_forward_data = None
        sp.state = ShardedState.UNSHARDED


def register_sharded(params: Sequence[ShardedParam]) -> None:
    """:meth:`ShardedParam.to_sharded` for each parameter: register the sharded parameter and
    free the unsharded storage (one Python call for the unit, not one per parameter).

    Args:
        params: the parameters.
    """
    for sp in params:
        param = sp.sharded_param
        for module, name in sp._registrations:  # _set_on_modules, inlined
            if _PLAIN_SETATTR.get(type(module)) or _plain_setattr(type(module)):
                module._parameters[name] = param
            else:
                setattr(module, name, param)
        if sp.extension is not None:
            sp.extension.free()
        data = sp._unsharded_data
        if data is not None:
            storage = data.untyped_storage()
            if storage.nbytes() != 0:
                storage.resize_(0)
        sp._post_forward_data = None
        sp.state = ShardedState.SHARDED


def unsharded_outs(params: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """:meth:`ShardedParam.unsharded_out` for each parameter, in one call (a unit's hot path).

    Args:
        params: the parameters (without an all-gather extension).

    Returns:
        Each parameter's flat compute-dtype buffer, with storage allocated.
    """
    outs = []
    for sp in params:
        data = sp._unsharded_data
        if data is None or data.dtype != sp.compute_dtype:
            numel = sp.padded_sharded_numel * sp.mesh_info.shard_size
            data = torch.empty(numel, dtype=sp.compute_dtype, device=sp.device)
            sp._unsharded_data = data
            sp._unsharded_param = None
        else:
            storage = data.untyped_storage()
            nbytes = data.numel() * data.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        outs.append(data)
    return outs
