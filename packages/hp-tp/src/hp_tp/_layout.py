"""Turning a user's layout spec (a Placement, a sequence of them, or an hp-dtensor Layout) into
the placements tuple DTensor wants on a given mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from hp_tp._dtensor import DeviceMesh, Placement

#: One tensor's layout: a Placement (1-D mesh), one Placement per mesh dim, or a Layout.
LayoutSpec: TypeAlias = "Placement | Sequence[Placement] | Any"


def _is_placement_seq(spec: object) -> bool:
    return (
        isinstance(spec, Sequence)
        and not isinstance(spec, str)
        and all(isinstance(p, Placement) for p in spec)
    )


def is_layout_spec(spec: object) -> bool:
    """Whether ``spec`` describes one tensor's layout (as opposed to a per-input tuple)."""
    if isinstance(spec, Placement) or _is_layout_object(spec):
        return True
    return _is_placement_seq(spec) and len(spec) > 0  # type: ignore[arg-type]


def _is_layout_object(spec: object) -> bool:
    return hasattr(spec, "to_placements") or (
        hasattr(spec, "placements") and not isinstance(spec, Sequence)
    )


def to_placements(spec: object, mesh: DeviceMesh, what: str) -> tuple[Placement, ...]:
    """The placements tuple ``spec`` stands for on ``mesh``.

    Raises:
        TypeError: when ``spec`` is not a Placement, a sequence of Placements or a Layout.
        ValueError: when the number of placements is not the mesh's number of dimensions.
    """
    placements: tuple[Placement, ...]
    if isinstance(spec, Placement):
        placements = (spec,)
    elif _is_placement_seq(spec):
        placements = tuple(spec)  # type: ignore[arg-type]
    elif hasattr(spec, "to_placements"):
        placements = tuple(spec.to_placements(mesh))
    elif hasattr(spec, "placements") and not isinstance(spec, Sequence):
        placements = tuple(spec.placements)
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
