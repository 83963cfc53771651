"""``ParallelDims``: the degrees of every parallel dimension and the meshes built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp_trainer._torch_compat import flatten_mesh

if TYPE_CHECKING:
    from hp_trainer.config import ParallelismConfig

__all__ = ["ParallelDims"]

# Order of the axes of the world mesh, outermost first (TorchTitan's order).
_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Degrees of pipeline, data (replicate/shard), context, tensor and expert parallelism.

    ``dp_replicate * dp_shard * cp * tp * pp`` must equal ``world_size``; ``dp_shard=-1`` is
    inferred from the other degrees. Expert parallelism borrows ranks from FSDP, CP and TP
    (``ep`` must divide ``dp_shard * cp * tp``; the expert-FSDP degree is
    ``dp_shard * cp * tp // ep``).

    Named meshes (``get_mesh(name)`` / ``get_optional_mesh(name)``) after :meth:`build_mesh`:
    ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (one axis each); ``dp``
    (dp_replicate x dp_shard, the data-loading axis, also called ``batch``); ``dp_shard_cp``
    (dp_shard x cp, the FSDP shard axis, also ``fsdp``); ``dp_cp`` (dp x cp, the axis the loss
    is averaged over, also ``loss``); ``fsdp_mesh`` (the 1-D or HSDP 2-D mesh handed to
    ``fully_shard``: axes ``(dp_replicate, dp_shard)``, or ``dp_shard_cp`` in place of
    ``dp_shard`` when ``cp > 1``); ``ep`` and ``efsdp`` when ``ep > 1``, with ``efsdp_mesh``
    (the mesh handed to ``fully_shard`` for the experts: ``efsdp``, or ``(dp_replicate, efsdp)``
    under HSDP, whose replicas hold the same experts too).

    Args:
        dp_replicate: Data-parallel replicate degree (HSDP outer axis / DDP).
        dp_shard: FSDP shard degree, -1 to infer.
        cp: Context-parallel degree.
        tp: Tensor-parallel degree.
        pp: Pipeline-parallel degree.
        ep: Expert-parallel degree.
        world_size: Total number of ranks.

    Raises:
        ValueError: If a degree is invalid or the product does not match ``world_size``.

    See Also:
        :titan:`torchtitan.distributed.parallel_dims.ParallelDims`: TorchTitan's class.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be an integer >= 1, got {value!r}")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others != 0:
                raise ValueError(
                    f"cannot infer dp_shard: world_size {self.world_size} is not divisible by "
                    f"dp_replicate*cp*tp*pp = {others}"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"ParallelDims.dp_shard must be -1 or >= 1, got {self.dp_shard}")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) "
                f"* tp({self.tp}) * pp({self.pp}) = {product} != world_size({self.world_size})"
            )
        if self.ep > 1:
            borrow = self.dp_shard * self.cp * self.tp
            if borrow % self.ep != 0:
                raise ValueError(
                    f"ep({self.ep}) must divide dp_shard*cp*tp = {borrow}: expert parallelism "
                    "borrows its ranks from FSDP, CP and TP"
                )

    # -- mesh ----------------------------------------------------------------------------

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Create the world mesh and its named sub-meshes.

        Args:
            device_type: Device type of the mesh (``"cpu"`` for gloo).

        Returns:
            The world mesh with axes ``pp, dp_replicate, dp_shard, cp, tp``.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.build_mesh`: TorchTitan's
            mesh.
        """
        shape = tuple(getattr(self, axis) for axis in _AXES)
        world = init_device_mesh(device_type, shape, mesh_dim_names=_AXES)
        meshes: dict[str, DeviceMesh] = {axis: world[axis] for axis in _AXES}
        meshes["world"] = world
        meshes["dp"] = flatten_mesh(world["dp_replicate", "dp_shard"], "dp")
        meshes["dp_shard_cp"] = flatten_mesh(world["dp_shard", "cp"], "dp_shard_cp")
        meshes["dp_cp"] = flatten_mesh(world["dp_replicate", "dp_shard", "cp"], "dp_cp")
        meshes["batch"] = meshes["dp"]
        meshes["fsdp"] = meshes["dp_shard_cp"]
        meshes["loss"] = meshes["dp_cp"]
        shard_axis = "dp_shard" if self.cp == 1 else "dp_shard_cp"
        if self.dp_replicate > 1:
            meshes["fsdp_mesh"] = world["dp_replicate", shard_axis]
        else:
            meshes["fsdp_mesh"] = world[shard_axis] if self.cp == 1 else meshes["dp_shard_cp"]
        if self.ep > 1:
            # EP borrows from dp_shard x cp x tp: split that flattened axis into (efsdp, ep).
            borrowed = flatten_mesh(world["dp_shard", "cp", "tp"], "dp_shard_cp_tp")
            efsdp = self.dp_shard * self.cp * self.tp // self.ep
            sparse = borrowed._unflatten(0, (efsdp, self.ep), ("efsdp", "ep"))
            meshes["efsdp"] = sparse["efsdp"]
            meshes["ep"] = sparse["ep"]
            meshes["efsdp_mesh"] = sparse["efsdp"]
            if self.dp_replicate > 1:  # the same split, under the replicate axis
                replicated = flatten_mesh(
                    world["dp_replicate", "dp_shard", "cp", "tp"], "dp_replicate_shard_cp_tp"
                )
                split = replicated._unflatten(
                    0, (self.dp_replicate, efsdp, self.ep), ("edp_replicate", "edp_shard", "edp_ep")
                )
                meshes["efsdp_mesh"] = split["edp_replicate", "edp_shard"]
        self._meshes = meshes
        return world

    def get_mesh(self, name: str) -> DeviceMesh:
        """Return a named mesh built by :meth:`build_mesh`.

        Args:
            name: One of the names listed in the class docstring.

        Returns:
            The mesh.

        Raises:
            RuntimeError: If :meth:`build_mesh` has not run.
            ValueError: For an unknown name.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.get_mesh`: TorchTitan's
            getter.
        """
        if not self._meshes:
            raise RuntimeError("ParallelDims.get_mesh() needs build_mesh() to have run first")
        if name not in self._meshes:
            raise ValueError(f"unknown mesh {name!r}; known: {', '.join(sorted(self._meshes))}")
        return self._meshes[name]

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        """Return a named mesh, or None when all of its axes have size 1.

        Args:
            name: One of the names listed in the class docstring.

        Returns:
            The mesh, or None for a trivial (size-1) or absent mesh.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.get_optional_mesh`.
        """
        if name not in self._meshes:
            if name in ("ep", "efsdp", "efsdp_mesh") and self._meshes:
                return None
            return self.get_mesh(name)
        mesh = self._meshes[name]
        return mesh if mesh.size() > 1 else None

    # -- facts ---------------------------------------------------------------------------

    @property
    def dp_enabled(self) -> bool:
        """Whether any data parallelism (replicate or shard) is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.dp_enabled`.
        """
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether HSDP/DDP replication is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.dp_replicate_enabled`.
        """
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Whether FSDP sharding is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.dp_shard_enabled`.
        """
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether FSDP wraps the model (dp_shard or cp greater than 1).

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.fsdp_enabled`.
        """
        return self.dp_shard > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        """Whether context parallelism is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.cp_enabled`.
        """
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor parallelism is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.tp_enabled`.
        """
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether pipeline parallelism is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.pp_enabled`.
        """
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        """Whether expert parallelism is on.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.ep_enabled`.
        """
        return self.ep > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        """Whether the loss can run on vocab-sharded logits (TP on).

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.loss_parallel_enabled`.
        """
        return self.tp > 1

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree, ``dp_replicate * dp_shard``.

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims`.
        """
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one sample, ``cp * tp * pp`` (used for per-device tokens/s).

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.non_data_parallel_size`.
        """
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """Sequence lengths must be multiples of this, ``tp * 2 * cp`` (SP and CP load balance).

        See Also:
            :titan:`torchtitan.distributed.parallel_dims.ParallelDims.seq_len_divisor`.
        """
        return self.tp * (self.cp * 2 if self.cp > 1 else 1)


def parallel_dims_from_config(p: ParallelismConfig, world_size: int) -> ParallelDims:
    """The ``ParallelDims`` of the ``[parallelism]`` section on ``world_size`` ranks."""
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        world_size=world_size,
    )
