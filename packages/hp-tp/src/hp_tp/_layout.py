"""Turning a user's layout spec (a Placement, a sequence of them, or an hp-dtensor Layout) into
the placements tuple DTensor wants on a given mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from hp_tp._dtensor import DeviceMesh, DTensor, Layout, Placement, Shard

#: One tensor's layout: a Placement (1-D mesh), one Placement per mesh dim, or a tensor Layout.
LayoutSpec: TypeAlias = "Placement | Sequence[Placement] | Layout"


def _is_placement_seq(spec: object) -> bool:
    return (
        isinstance(spec, Sequence)
        and not isinstance(spec, str)
        and len(spec) > 0
        and all(isinstance(p, Placement) for p in spec)
    )


def is_layout_spec(spec: object) -> bool:
    """Whether ``spec`` describes one tensor's layout (as opposed to a per-input tuple)."""
    return isinstance(spec, Placement | Layout) or _is_placement_seq(spec)


def to_placements(spec: object, mesh: DeviceMesh, what: str) -> tuple[Placement, ...]:
    """The placements tuple ``spec`` stands for on ``mesh``.

    Raises:
        TypeError: when ``spec`` is not a Placement, a sequence of Placements or a tensor Layout.
        ValueError: when the number of placements is not the mesh's number of dimensions, or a
            Layout's device matrix is not the mesh's shape.
    """
    placements: tuple[Placement, ...]
    if isinstance(spec, Placement):
        placements = (spec,)
    elif _is_placement_seq(spec):
        placements = tuple(spec)  # type: ignore[arg-type]
    elif isinstance(spec, Layout):
        if not spec.is_tensor_layout:
            raise ValueError(
                f"{what}: {spec!r} is a device layout; call it with one entry per tensor dim"
            )
        if tuple(spec.mesh_shape) != tuple(mesh.shape):
            raise ValueError(
                f"{what}: the layout's device matrix {spec.mesh_shape} is not the shape of the "
                f"mesh {tuple(mesh.shape)}"
            )
        placements = spec.placements
    else:
        raise TypeError(
            f"{what}: expected a Placement, a sequence of Placements (one per mesh dim) or an "
            f"hp_dtensor Layout, got {spec!r}"
        )
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements {placements} given for a {mesh.ndim}-D mesh; "
            "give one placement per mesh dimension"
        )
    return placements


def has_layout(tensor: DTensor, placements: Sequence[Placement]) -> bool:
    """Whether ``tensor`` is already laid out as ``placements``.

    A negative shard dim names the same layout as its non-negative form (``Shard(-1)`` is
    ``Shard(ndim - 1)``, which is how DTensor stores it), so callers skip ``redistribute`` (a
    no-op that still costs a Python round trip) whenever the layout already matches.
    """
    ndim = tensor.ndim
    wanted = tuple(Shard(p.dim + ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)
    return tuple(tensor.placements) == wanted
