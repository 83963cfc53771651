"""HyperParallel's ``Layout``: name the mesh axes, then say which axes shard each tensor dim.

A *device layout* ``Layout(mesh_shape, alias_name, rank_list=None)`` names the axes of a device
matrix. Calling it with one entry per tensor dim gives a *tensor layout*: an entry is an axis
alias (the dim is sharded over that axis), ``"None"`` (not sharded), or a tuple of aliases (the
dim is sharded over several axes, the first one *major*: the dim is split over the first axis,
each piece over the second, and so on). Mesh axes used by no tensor dim are replicated, or
``Partial`` when named in ``partial=``.

A tensor layout converts both ways to torch's ``(DeviceMesh, placements)``: an axis order that
differs from the mesh order becomes ``_StridedShard`` (as FSDP does for FSDP x TP), so any order
round-trips. Global shapes are metadata: uneven shards are exact.

See Also:
    :pt:`torch.distributed.tensor.DTensor`: the tensor type layouts describe;
    :pt:`torch.distributed.tensor.placement_types`: ``Shard``, ``Replicate``, ``Partial``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from hp_dtensor._torch_compat import StridedShard as _StridedShard
from hp_dtensor._torch_compat import compute_local_shape_and_global_offset, mesh_broadcast
from hp_dtensor.device import (
    DEVICE_TYPE_CPU,
    DEVICE_TYPE_META,
    get_device,
    get_device_type,
    is_accelerator,
)

__all__ = ["NONE_ALIAS", "Layout", "distribute_with_layout", "from_local_with_layout"]

NONE_ALIAS = "None"
"""The tensor-map entry of a dim that is not sharded."""

_REDUCE_OPS = ("sum", "avg", "max", "min", "product")
TensorMapEntry = str | Sequence[str]


class _MeshHolder:
    """Lazily built DeviceMesh shared by a device layout and the tensor layouts made from it."""

    def __init__(self, mesh: DeviceMesh | None, device_type: str | None) -> None:
        self.mesh = mesh
        self.device_type = device_type


class Layout:
    """A named device matrix, and (once called) the sharding of a tensor over it.

    Args:
        mesh_shape: the size of each mesh axis.
        alias_name: one unique name per mesh axis (``"None"`` is reserved).
        rank_list: the global ranks of the matrix in row-major order; default
            ``range(prod(mesh_shape))``.
        device_type: the device of the mesh built by :attr:`device_mesh` (keyword-only
            extension); default :func:`hp_dtensor.device.get_device_type`.

    Raises:
        ValueError: for mismatched lengths, repeated or reserved aliases, non-positive sizes, or
            a rank list that does not match the mesh (wrong length, repeats, negative ranks, ranks
            outside the world).
        TypeError: for aliases that are not strings.

    Example:
        .. code-block:: python

            layout = Layout((2, 2), ("dp", "tp"))
            w = layout(("tp", "dp"), "None")  # dim 0 split over tp, then each piece over dp
            w.placements  # (_StridedShard(dim=0, sf=2), Shard(dim=0))

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh`: torch's named device matrix.
    """

    def __init__(
        self,
        mesh_shape: Sequence[int],
        alias_name: Sequence[str],
        rank_list: Sequence[int] | None = None,
        *,
        device_type: str | None = None,
    ) -> None:
        shape = tuple(int(s) for s in mesh_shape)
        names = tuple(alias_name)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"mesh_shape must be one or more positive sizes, got {mesh_shape!r}")
        if len(names) != len(shape):
            raise ValueError(
                f"alias_name {names} must name each of the {len(shape)} axes of mesh_shape {shape}"
            )
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"mesh axis aliases must be strings, got {name!r}")
        if NONE_ALIAS in names:
            raise ValueError(f"{NONE_ALIAS!r} is reserved for unsharded dims; rename that axis")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis aliases must be unique, got {names}")
        size = math.prod(shape)
        ranks = tuple(range(size)) if rank_list is None else tuple(int(r) for r in rank_list)
        if len(ranks) != size:
            raise ValueError(
                f"rank_list has {len(ranks)} ranks but mesh_shape {shape} needs {size}"
            )
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise ValueError(f"rank_list must hold distinct non-negative ranks, got {list(ranks)}")
        if dist.is_initialized() and max(ranks) >= dist.get_world_size():
            raise ValueError(
                f"rank_list {list(ranks)} names ranks outside the world of size "
                f"{dist.get_world_size()}"
            )
        self._mesh_shape = shape
        self._alias_name = names
        self._rank_list = ranks
        self._tensor_map: tuple[tuple[str, ...], ...] | None = None
        self._partial: dict[str, str] = {}
        self._holder = _MeshHolder(None, device_type)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> Layout:
        """Make a device layout of an existing mesh (axis names default to ``axis0``, ...).

        Args:
            device_mesh: the mesh.

        Returns:
            The device layout; its :attr:`device_mesh` is ``device_mesh`` itself.

        See Also:
            :pt:`torch.distributed.device_mesh.DeviceMesh`: the mesh type.
        """
        names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
        layout = cls(
            tuple(device_mesh.mesh.shape),
            names,
            device_mesh.mesh.flatten().tolist(),
            device_type=device_mesh.device_type,
        )
        layout._holder.mesh = device_mesh
        return layout

    @classmethod
    def from_placements(
        cls, device_mesh: DeviceMesh, placements: Sequence[Placement], ndim: int
    ) -> Layout:
        """Make the tensor layout of ``placements`` on ``device_mesh`` for an ``ndim``-dim tensor.

        Args:
            device_mesh: the mesh.
            placements: one placement per mesh axis (``Shard``, ``_StridedShard``, ``Replicate``,
                ``Partial``).
            ndim: the tensor's number of dims.

        Returns:
            The tensor layout (its :attr:`placements` equal ``placements``).

        Raises:
            ValueError: for a wrong number of placements, a dim out of range, or strided
                placements that no axis order produces.
            TypeError: for a placement type this module does not know.

        See Also:
            :pt:`torch.distributed.tensor.DTensor.placements`: torch's per-axis placements.
        """
        placements = tuple(placements)
        if len(placements) != device_mesh.ndim:
            raise ValueError(
                f"got {len(placements)} placements for a {device_mesh.ndim}-D mesh: {placements}"
            )
        base = cls.from_device_mesh(device_mesh)
        names = base._alias_name
        per_dim: dict[int, list[str]] = {}
        partial: dict[str, str] = {}
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard | _StridedShard):
                dim = placement.dim if placement.dim >= 0 else placement.dim + ndim
                if not 0 <= dim < ndim:
                    raise ValueError(f"{placement} is out of range for a {ndim}-D tensor")
                per_dim.setdefault(dim, []).append(names[axis])
            elif isinstance(placement, Partial):
                partial[names[axis]] = str(placement.reduce_op)
            elif not isinstance(placement, Replicate):
                raise TypeError(f"unsupported placement {placement!r} on mesh axis {axis}")
        entries: list[TensorMapEntry] = [NONE_ALIAS] * ndim
        for dim, axes in per_dim.items():
            for order in itertools.permutations(axes):
                candidate = base._placements_for({dim: order}, {}, ndim)
                mine = [candidate[names.index(a)] for a in axes]
                theirs = [_normalized(placements[names.index(a)], ndim) for a in axes]
                if mine == theirs:
                    entries[dim] = tuple(order) if len(order) > 1 else order[0]
                    break
            else:
                raise ValueError(
                    f"the placements {placements} of tensor dim {dim} match no order of the mesh "
                    f"axes {tuple(axes)}"
                )
        return base(*entries, partial=partial)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Rebuild a layout from :meth:`to_dict` output.

        Args:
            data: the dictionary.

        Returns:
            The layout.

        Raises:
            ValueError: when keys are missing.

        See Also:
            :pt:`torch.distributed.tensor.DTensor.placements`: torch keeps placements, not dicts.
        """
        missing = {"mesh_shape", "alias_name"} - set(data)
        if missing:
            raise ValueError(f"a layout dict needs the keys {sorted(missing)}")
        base = cls(data["mesh_shape"], data["alias_name"], data.get("rank_list"))
        tensor_map = data.get("tensor_map")
        if tensor_map is None:
            return base
        entries = [e if isinstance(e, str) else tuple(e) for e in tensor_map]
        return base(*entries, partial=dict(data.get("partial") or {}))

    def __call__(
        self, *tensor_map: TensorMapEntry, partial: Mapping[str, str] | None = None
    ) -> Layout:
        """Make the tensor layout with one entry per tensor dim.

        Args:
            *tensor_map: per tensor dim an alias, ``"None"``, or a tuple of aliases (major first).
            partial: mesh axes whose values are partial, mapped to their reduce op (``"sum"``,
                ``"avg"``, ``"max"``, ``"min"``, ``"product"``; keyword-only extension).

        Returns:
            A new tensor layout sharing this layout's mesh.

        Raises:
            ValueError: for an unknown alias, an axis used twice (also between the map and
                ``partial``), an unknown or mixed reduce ops, or no entries.
            TypeError: for entries that are not strings or tuples of strings.

        See Also:
            :pt:`torch.distributed.tensor.Shard`: the placement a sharded dim becomes.
        """
        if not tensor_map:
            raise ValueError("give one tensor-map entry per tensor dim (use 'None' for none)")
        parsed: list[tuple[str, ...]] = []
        used: list[str] = []
        for entry in tensor_map:
            if isinstance(entry, str):
                aliases: tuple[str, ...] = () if entry == NONE_ALIAS else (entry,)
            elif isinstance(entry, Sequence) and all(isinstance(a, str) for a in entry):
                aliases = tuple(a for a in entry if a != NONE_ALIAS)
            else:
                raise TypeError(
                    f"a tensor-map entry is an alias or a tuple of aliases, got {entry!r}"
                )
            for alias in aliases:
                self._check_alias(alias)
            used += aliases
            parsed.append(aliases)
        partial_ops = dict(partial or {})
        for alias, op in partial_ops.items():
            self._check_alias(alias)
            if op not in _REDUCE_OPS:
                raise ValueError(f"unknown reduce op {op!r} for axis {alias!r}; use {_REDUCE_OPS}")
        if len(set(partial_ops.values())) > 1:
            raise ValueError(
                f"use one reduce op for all partial axes (torch's DTensor cannot mix them), "
                f"got {partial_ops}"
            )
        used += list(partial_ops)
        repeated = sorted({a for a in used if used.count(a) > 1})
        if repeated:
            raise ValueError(f"mesh axis {repeated} is used more than once in {tensor_map}")
        layout = object.__new__(Layout)
        layout._mesh_shape = self._mesh_shape
        layout._alias_name = self._alias_name
        layout._rank_list = self._rank_list
        layout._tensor_map = tuple(parsed)
        layout._partial = partial_ops
        layout._holder = self._holder
        return layout

    def _check_alias(self, alias: str) -> None:
        if alias not in self._alias_name:
            raise ValueError(
                f"unknown mesh axis alias {alias!r}; the layout has {self._alias_name}"
            )

    # -- properties ---------------------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The size of each mesh axis."""
        return self._mesh_shape

    @property
    def alias_name(self) -> tuple[str, ...]:
        """The name of each mesh axis."""
        return self._alias_name

    @property
    def rank_list(self) -> tuple[int, ...]:
        """The global ranks of the device matrix, row-major."""
        return self._rank_list

    @property
    def is_tensor_layout(self) -> bool:
        """True once the layout says how a tensor is sharded (it was called)."""
        return self._tensor_map is not None

    @property
    def tensor_map(self) -> tuple[tuple[str, ...], ...]:
        """The aliases sharding each tensor dim, major first; an empty tuple for an unsharded dim.

        Raises:
            ValueError: on a device layout (not called yet).
        """
        return self._require_tensor_map()

    @property
    def partial(self) -> dict[str, str]:
        """The partial mesh axes and their reduce ops."""
        return dict(self._partial)

    @property
    def ndim(self) -> int:
        """The number of tensor dims of a tensor layout."""
        return len(self._require_tensor_map())

    def _require_tensor_map(self) -> tuple[tuple[str, ...], ...]:
        if self._tensor_map is None:
            raise ValueError(
                "this is a device layout; call it with one entry per tensor dim first, e.g. "
                f"layout({self._alias_name[0]!r}, 'None')"
            )
        return self._tensor_map

    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh of this layout (built on first use; a collective on all ranks)."""
        holder = self._holder
        if holder.mesh is None:
            if not dist.is_initialized():
                raise RuntimeError("building a layout's DeviceMesh needs a default process group")
            device_type = holder.device_type or get_device_type()
            mesh_tensor = torch.tensor(self._rank_list, dtype=torch.int).reshape(self._mesh_shape)
            holder.mesh = DeviceMesh(device_type, mesh_tensor, mesh_dim_names=self._alias_name)
        return holder.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The torch placements, one per mesh axis (``_StridedShard`` for non-mesh orders)."""
        tensor_map = self._require_tensor_map()
        by_dim = {dim: aliases for dim, aliases in enumerate(tensor_map) if aliases}
        return self._placements_for(by_dim, self._partial, len(tensor_map))

    def _placements_for(
        self, by_dim: Mapping[int, Sequence[str]], partial: Mapping[str, str], ndim: int
    ) -> tuple[Placement, ...]:
        names = self._alias_name
        result: list[Placement] = [Replicate() for _ in names]
        for alias, op in partial.items():
            result[names.index(alias)] = Partial(op)
        for dim, aliases in by_dim.items():
            for position, alias in enumerate(aliases):
                axis = names.index(alias)
                # Major axes that come later in mesh order were already split off: stride.
                split = math.prod(
                    self._mesh_shape[names.index(m)]
                    for m in aliases[:position]
                    if names.index(m) > axis
                )
                result[axis] = Shard(dim) if split == 1 else _StridedShard(dim, split_factor=split)
        return tuple(result)

    # -- presentation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly description (``from_dict`` reverses it).

        Returns:
            ``mesh_shape``, ``alias_name``, ``rank_list`` and, for tensor layouts, ``tensor_map``
            (per dim ``"None"``, an alias, or a list of aliases) and ``partial``.

        See Also:
            :pt:`torch.distributed.tensor.DTensor.placements`: torch's (non-dict) description.
        """
        data: dict[str, Any] = {
            "mesh_shape": list(self._mesh_shape),
            "alias_name": list(self._alias_name),
            "rank_list": list(self._rank_list),
        }
        if self._tensor_map is not None:
            data["tensor_map"] = [self._entry_repr(aliases) for aliases in self._tensor_map]
            data["partial"] = dict(self._partial)
        return data

    @staticmethod
    def _entry_repr(aliases: tuple[str, ...]) -> str | list[str]:
        if not aliases:
            return NONE_ALIAS
        return aliases[0] if len(aliases) == 1 else list(aliases)

    def __repr__(self) -> str:
        parts = [f"mesh_shape={self._mesh_shape}", f"alias_name={self._alias_name}"]
        if self._rank_list != tuple(range(len(self._rank_list))):
            parts.append(f"rank_list={list(self._rank_list)}")
        if self._tensor_map is not None:
            entries = tuple(
                tuple(e) if isinstance(e, list) else e
                for e in (self._entry_repr(a) for a in self._tensor_map)
            )
            parts.append(f"tensor_map={entries}")
            if self._partial:
                parts.append(f"partial={self._partial}")
        return f"Layout({', '.join(parts)})"

    def _key(self) -> tuple[Any, ...]:
        return (
            self._mesh_shape,
            self._alias_name,
            self._rank_list,
            self._tensor_map,
            tuple(sorted(self._partial.items())),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _normalized(placement: Placement, ndim: int) -> Placement:
    """The placement with a negative shard dim made non-negative."""
    if isinstance(placement, _StridedShard) and placement.dim < 0:
        return _StridedShard(placement.dim + ndim, split_factor=placement.split_factor)
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _require_tensor_layout(layout: Layout, ndim: int) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a Layout, got {type(layout).__name__}")
    if layout.ndim != ndim:
        raise ValueError(f"the layout {layout} is for {layout.ndim}-D tensors, got a {ndim}-D one")


def _partition_exact(tensor: torch.Tensor, op: str, coordinate: int) -> torch.Tensor:
    """This rank's partial value of ``tensor`` such that reducing with ``op`` is exact."""
    if op in ("avg", "max", "min") or coordinate == 0:
        return tensor
    if op == "sum":
        return torch.zeros_like(tensor)
    return torch.ones_like(tensor)  # product


def distribute_with_layout(
    tensor: torch.Tensor, tensor_layout: Layout, *, src_data_rank: int | None = 0
) -> DTensor:
    """Distribute a full tensor according to a tensor layout.

    Sharded and replicated axes follow ``torch.distributed.tensor.distribute_tensor`` (data from
    ``src_data_rank``; None means every rank already holds the full tensor and nothing is sent).
    A ``Partial`` axis gets an exact split: for ``sum`` the value on coordinate 0 and zeros
    elsewhere, for ``product`` the value and ones, for ``avg``/``max``/``min`` the value
    everywhere (torch divides by the axis size instead, which is not exact).

    Args:
        tensor: the full tensor (same on every rank when ``src_data_rank`` is None).
        tensor_layout: the tensor layout.
        src_data_rank: the rank whose data is distributed, as in torch.

    Returns:
        The DTensor (global shape = ``tensor.shape``; uneven shards allowed).

    Raises:
        TypeError: when ``tensor_layout`` is not a Layout.
        ValueError: when it is not a tensor layout of ``tensor.ndim`` dims.

    See Also:
        :pt:`torch.distributed.tensor.distribute_tensor`: torch's placement-based version.
    """
    _require_tensor_layout(tensor_layout, tensor.ndim)
    mesh = tensor_layout.device_mesh
    placements = tensor_layout.placements
    plain = [Replicate() if p.is_partial() else p for p in placements]
    if src_data_rank is not None and any(isinstance(p, _StridedShard) for p in plain):
        # torch scatters strided shards only when they divide evenly: broadcast, then split.
        tensor = tensor.detach().clone().contiguous()
        for axis in range(mesh.ndim):
            mesh_broadcast(tensor, mesh, mesh_dim=axis, group_src=src_data_rank)
        src_data_rank = None
    result = distribute_tensor(tensor, mesh, plain, src_data_rank=src_data_rank)
    if not tensor_layout.partial:
        return result
    local = result.to_local()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    for axis, placement in enumerate(placements):
        if isinstance(placement, Partial):
            local = _partition_exact(local, str(placement.reduce_op), coordinate[axis])
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=result.shape, stride=result.stride()
    )


def _global_shape(local: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> torch.Size:
    """Sum local sizes over each sharding axis (exact for uneven shards; one small all-reduce
    per sharding mesh axis)."""
    sizes = list(local.shape)
    names = layout.alias_name
    device = get_device() if is_accelerator(mesh.device_type) else torch.device(DEVICE_TYPE_CPU)
    for dim, aliases in enumerate(layout.tensor_map):
        for alias in aliases:
            size = torch.tensor([sizes[dim]], dtype=torch.int64, device=device)
            dist.all_reduce(size, group=mesh.get_group(names.index(alias)))
            sizes[dim] = int(size.item())
    return torch.Size(sizes)


def from_local_with_layout(
    local: torch.Tensor,
    tensor_layout: Layout,
    *,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
    run_check: bool = False,
) -> DTensor:
    """Wrap this rank's local shard into a DTensor with a tensor layout.

    Args:
        local: the local shard.
        tensor_layout: the tensor layout.
        shape: the global shape; when omitted it is computed exactly from the local sizes (a
            collective on every sharding axis; uneven shards are correct).
        stride: the global stride; default contiguous for ``shape``.
        run_check: as in ``DTensor.from_local`` (checks replicated data across ranks).

    Returns:
        The DTensor.

    Raises:
        TypeError: when ``tensor_layout`` is not a Layout.
        ValueError: when it is not a tensor layout of ``local.ndim`` dims, or when the local
            shape is not this rank's shard of the global shape.

    See Also:
        :pt:`torch.distributed.tensor.DTensor.from_local`: torch's placement-based version (which
        assumes even shards when no shape is given).
    """
    _require_tensor_layout(tensor_layout, local.ndim)
    mesh = tensor_layout.device_mesh
    global_shape = (
        torch.Size(shape) if shape is not None else _global_shape(local, tensor_layout, mesh)
    )
    expected, _ = compute_local_shape_and_global_offset(
        global_shape, mesh, tensor_layout.placements, skip_offset=True
    )
    if tuple(expected) != tuple(local.shape):
        raise ValueError(
            f"a local shard of shape {tuple(local.shape)} does not fit global shape "
            f"{tuple(global_shape)} with {tensor_layout}: this rank should hold {tuple(expected)} "
            "(shards are split like torch.chunk: the first ranks get the larger pieces)"
        )
    if stride is None:
        stride = torch.empty(global_shape, device=DEVICE_TYPE_META).stride()
    return DTensor.from_local(
        local,
        mesh,
        tensor_layout.placements,
        run_check=run_check,
        shape=global_shape,
        stride=tuple(stride),
    )
