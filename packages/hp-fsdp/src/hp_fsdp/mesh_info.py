"""Which process groups a ``fully_shard`` unit shards over and replicates over.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo`: PyTorch's equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from hp_fsdp._torch_compat import concatenate_meshes, flatten_mesh
from hp_fsdp.errors import FSDPUsageError

__all__ = [
    "DDPMeshInfo",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "MeshInfo",
    "PostForwardInfo",
    "ShardPlacementResult",
    "is_placement_result",
    "mesh_info_from_mesh",
    "placement_mesh_info",
]


@dataclass(eq=False)
class MeshInfo:
    """A data-parallel mesh: the shard axis (last mesh dim) and, for HSDP, the replicate axis.

    Args:
        mesh: the 1-D (FSDP) or 2-D (HSDP: replicate x shard) device mesh.
        replicate_only: the mesh is 1-D and only replicates (``replicate``): shard size 1.
        spmd_mesh: with ``fully_shard(dp_mesh_dims=...)``, the full SPMD mesh the parameters
            are DTensors on (``mesh`` is then its data-parallel submesh); None otherwise.
        dp_mesh_dims: the data-parallel dim names of ``spmd_mesh``; None otherwise.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo`: PyTorch's class.
    """

    mesh: DeviceMesh
    replicate_only: bool = False
    spmd_mesh: DeviceMesh | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None
    shard_group: dist.ProcessGroup = field(init=False)
    shard_size: int = field(init=False)
    shard_rank: int = field(init=False)
    replicate_group: dist.ProcessGroup | None = field(init=False, default=None)
    replicate_size: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        if self.replicate_only:
            # No shard axis: collectives over it are skipped (size 1); the group is a stand-in.
            # A 2-D (HSDP) mesh replicates over all its ranks: its dims flattened into one group.
            flat = self.mesh
            if flat.ndim > 1:
                names = flat.mesh_dim_names
                if names is None:
                    raise ValueError(
                        f"replicating over a {flat.ndim}-D mesh needs mesh_dim_names, got none"
                    )
                flat = flatten_mesh(flat, "_".join(names))
            self.shard_group = flat.get_group(0)
            self.shard_size = 1
            self.shard_rank = 0
            self.replicate_group = flat.get_group(0)
            self.replicate_size = flat.size(0)
            return
        shard_dim = self.mesh.ndim - 1
        self.shard_group = self.mesh.get_group(shard_dim)
        self.shard_size = self.mesh.size(shard_dim)
        self.shard_rank = self.mesh.get_local_rank(shard_dim)
        if self.mesh.ndim == 2:
            self.replicate_group = self.mesh.get_group(0)
            self.replicate_size = self.mesh.size(0)

    @property
    def is_hsdp(self) -> bool:
        """True when the mesh has a replicate axis (HSDP)."""
        return self.replicate_group is not None

    @property
    def mesh_label(self) -> str:
        """A short name of the mesh for messages: its dim names, or its size."""
        names = self.mesh.mesh_dim_names
        return "x".join(names) if names else f"mesh of {self.mesh.size()}"


@dataclass(eq=False)
class PostForwardInfo:
    """Where a unit's parameters live between forward and backward when resharded to ``k`` ranks.

    Args:
        group: the process group of the ``k`` consecutive shard ranks this rank belongs to.
        size: ``k``.
        rank: this rank's index in ``group``.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: ``reshard_after_forward`` given as an int.
    """

    group: dist.ProcessGroup
    size: int
    rank: int


def mesh_info_from_mesh(mesh: DeviceMesh) -> MeshInfo:
    """Build the :class:`MeshInfo` of a 1-D or 2-D mesh.

    Args:
        mesh: the data-parallel mesh.

    Returns:
        Its :class:`MeshInfo`.

    Raises:
        ValueError: for a mesh of another dimensionality, or a 2-D mesh without dim names.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: the ``mesh`` argument.
    """
    if mesh.ndim not in (1, 2):
        # PyTorch's exact message (users match it); pass dp_mesh_dims for a larger mesh.
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FSDPUsageError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
            "('replicate', 'shard'); got none"
        )
    return MeshInfo(mesh)


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Names of the data-parallel dims of a full SPMD mesh (``fully_shard(dp_mesh_dims=...)``).

    Args:
        shard: the dim name(s) parameters are sharded over.
        replicate: the dim name(s) parameters are replicated over.

    See Also:
        :pt:`torch.distributed.fsdp.DataParallelMeshDims`: PyTorch's dataclass (same fields).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims, got "
                "neither"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The shard dim names as a tuple (empty when none)."""
        return _dim_names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """The replicate dim names as a tuple (empty when none)."""
        return _dim_names(self.replicate)


@dataclass
class _DataParallelMeshInfoBase:
    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None
    spmd_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise ValueError(
                "a data-parallel mesh info needs shard_mesh_dim, replicate_mesh_dim or both, "
                "got neither"
            )


@dataclass
class FSDPMeshInfo(_DataParallelMeshInfoBase):
    """A mesh dim to shard over: its process group, size and this rank's index.

    Args:
        mesh: the device mesh.
        shard_mesh_dim: the dim parameters are sharded over.
        replicate_mesh_dim: the dim replicated over (only for :class:`HSDPMeshInfo`).
        dp_mesh_dims: the data-parallel dim names of a full SPMD mesh (PyTorch's field).
        spmd_mesh: that full mesh.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo`: PyTorch's class.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard_mesh_dim is None:
            raise ValueError(f"{type(self).__name__} needs shard_mesh_dim, got None")
        self.shard_mesh_size: int = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group: dist.ProcessGroup = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank: int = self.mesh.get_local_rank(self.shard_mesh_dim)


@dataclass
class DDPMeshInfo(_DataParallelMeshInfoBase):
    """A mesh dim to replicate over (gradients all-reduced): its group, size and rank.

    Args:
        mesh: the device mesh.
        shard_mesh_dim: the dim sharded over (only for :class:`HSDPMeshInfo`).
        replicate_mesh_dim: the dim parameters are replicated over.
        dp_mesh_dims: the data-parallel dim names of a full SPMD mesh (PyTorch's field).
        spmd_mesh: that full mesh.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.DDPMeshInfo`: PyTorch's class.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise ValueError(f"{type(self).__name__} needs replicate_mesh_dim, got None")
        self.replicate_mesh_size: int = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group: dist.ProcessGroup = self.mesh.get_group(
            self.replicate_mesh_dim
        )
        self.replicate_mesh_rank: int = self.mesh.get_local_rank(self.replicate_mesh_dim)


@dataclass
class HSDPMeshInfo(FSDPMeshInfo, DDPMeshInfo):
    """A replicate dim and a shard dim (HSDP).

    Args:
        mesh: the 2-D device mesh.
        shard_mesh_dim: the dim parameters are sharded over.
        replicate_mesh_dim: the dim they are replicated over.
        dp_mesh_dims: the data-parallel dim names of a full SPMD mesh (PyTorch's field).
        spmd_mesh: that full mesh.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo`: PyTorch's class.
    """


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return: a placement and the mesh to shard over.

    Args:
        placement: ``Shard(dim)``, or None for ``Shard(0)``.
        mesh_info: the parameter's data-parallel mesh.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult`.
    """

    placement: Shard | None
    mesh_info: FSDPMeshInfo


def is_placement_result(value: object) -> bool:
    """Whether ``value`` is a ``ShardPlacementResult``, ours or PyTorch's (same two fields).

    Args:
        value: what ``shard_placement_fn`` returned.

    Returns:
        True for an object with ``placement`` and ``mesh_info``.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult`.
    """
    if isinstance(value, ShardPlacementResult):
        return True
    return type(value).__name__ == "ShardPlacementResult" and all(
        hasattr(value, field) for field in ("placement", "mesh_info")
    )


def placement_mesh_info(user_info: object, default: MeshInfo) -> MeshInfo:
    """The :class:`MeshInfo` of a ``ShardPlacementResult.mesh_info`` (ours or PyTorch's).

    Args:
        user_info: an :class:`FSDPMeshInfo` / :class:`HSDPMeshInfo` (or PyTorch's classes): a
            1-D mesh to shard over, a 2-D (replicate, shard) mesh, a named dim of a larger mesh,
            or a full SPMD mesh with ``dp_mesh_dims``.
        default: the unit's own mesh info (returned when ``user_info`` describes its groups).

    Returns:
        The mesh info hp-fsdp shards the parameter with.

    Raises:
        TypeError: for an object without a mesh.
        ValueError: for a mesh info without a shard dim, or a layout other than those above.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult`.
    """
    mesh = getattr(user_info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "ShardPlacementResult.mesh_info must be an FSDPMeshInfo or HSDPMeshInfo with a "
            f"DeviceMesh, got {type(user_info).__name__}"
        )
    shard_dim = getattr(user_info, "shard_mesh_dim", None)
    replicate_dim = getattr(user_info, "replicate_mesh_dim", None)
    if shard_dim is None:
        raise ValueError(
            "a per-parameter mesh needs a shard dim (FSDPMeshInfo or HSDPMeshInfo), got "
            f"{type(user_info).__name__} without shard_mesh_dim"
        )
    spmd_mesh = getattr(user_info, "spmd_mesh", None)
    dims = getattr(user_info, "dp_mesh_dims", None)
    if spmd_mesh is not None and dims is not None:
        info = _spmd_mesh_info(spmd_mesh, dims)
    elif (replicate_dim, shard_dim, mesh.ndim) in ((None, 0, 1), (0, 1, 2)):
        info = MeshInfo(mesh)
    elif replicate_dim is None and mesh.mesh_dim_names is not None:
        info = MeshInfo(mesh[mesh.mesh_dim_names[shard_dim]])
    else:
        raise ValueError(
            "a per-parameter mesh must be 1-D, 2-D (replicate dim 0, shard dim 1), or a named "
            f"shard dim of a larger mesh; got a {mesh.ndim}-D mesh with shard dim {shard_dim} "
            f"and replicate dim {replicate_dim}"
        )
    groups = (info.shard_group, info.replicate_group)
    same = groups == (default.shard_group, default.replicate_group)
    return default if same and info.mesh == default.mesh and not default.replicate_only else info


def _dim_names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _spmd_mesh_info(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims) -> MeshInfo:
    """Build the :class:`MeshInfo` of the data-parallel dims of a full SPMD mesh.

    The shard dim(s) (flattened when several) become the shard axis and the replicate dim(s)
    (flattened when several) the replicate axis, as in PyTorch's
    ``fully_shard(dp_mesh_dims=...)``; with replicate dims only, the parameters are kept whole
    and their gradients all-reduced (DDP).
    """
    if not isinstance(dp_mesh_dims, DataParallelMeshDims) and type(dp_mesh_dims).__name__ == (
        "DataParallelMeshDims"
    ):  # PyTorch's dataclass: same two fields
        dp_mesh_dims = DataParallelMeshDims(
            getattr(dp_mesh_dims, "shard", None), getattr(dp_mesh_dims, "replicate", None)
        )
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(
            f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dp_mesh_dims).__name__}"
        )
    shard = _dim_names(dp_mesh_dims.shard)
    replicate = _dim_names(dp_mesh_dims.replicate)
    if not shard and not replicate:
        raise ValueError(
            "At least one of shard or replicate must be set in dp_mesh_dims, got neither"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided (fully_shard("
            "dp_mesh_dims=...))"
        )
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names} (dp_mesh_dims)"
            )

    def submesh(dims: tuple[str, ...]) -> DeviceMesh:
        return mesh[dims[0]] if len(dims) == 1 else flatten_mesh(mesh[dims], "_".join(dims))

    if not shard:  # DDP: parameters stay whole, gradients are all-reduced over the dims
        return MeshInfo(
            submesh(replicate), replicate_only=True, spmd_mesh=mesh, dp_mesh_dims=dp_mesh_dims
        )
    dp_mesh = submesh(shard)
    if replicate:
        dp_mesh = concatenate_meshes([submesh(replicate), dp_mesh])
    return MeshInfo(dp_mesh, spmd_mesh=mesh, dp_mesh_dims=dp_mesh_dims)
