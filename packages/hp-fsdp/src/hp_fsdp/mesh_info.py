"""Which process groups a ``fully_shard`` unit shards over and replicates over.

See Also:
    ``torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo``: PyTorch's equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshInfo", "PostForwardInfo", "mesh_info_from_mesh"]


@dataclass(eq=False)
class MeshInfo:
    """A data-parallel mesh: the shard axis (last mesh dim) and, for HSDP, the replicate axis.

    Args:
        mesh: the 1-D (FSDP) or 2-D (HSDP: replicate x shard) device mesh.

    See Also:
        ``torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo``: PyTorch's class.
    """

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup = field(init=False)
    shard_size: int = field(init=False)
    shard_rank: int = field(init=False)
    replicate_group: dist.ProcessGroup | None = field(init=False, default=None)
    replicate_size: int = field(init=False, default=1)

    def __post_init__(self) -> None:
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


@dataclass(eq=False)
class PostForwardInfo:
    """Where a unit's parameters live between forward and backward when resharded to ``k`` ranks.

    Args:
        group: the process group of the ``k`` consecutive shard ranks this rank belongs to.
        size: ``k``.
        rank: this rank's index in ``group``.

    See Also:
        ``torch.distributed.fsdp.fully_shard``: ``reshard_after_forward`` given as an int.
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
        ``torch.distributed.fsdp.fully_shard``: the ``mesh`` argument.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1-D (FSDP) or 2-D (HSDP) DeviceMesh, got a {mesh.ndim}-D "
            f"mesh {mesh}"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "a 2-D mesh for HSDP needs mesh_dim_names, e.g. ('replicate', 'shard'), got none"
        )
    return MeshInfo(mesh)
