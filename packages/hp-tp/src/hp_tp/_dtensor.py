"""The DTensor names hp-tp builds on, imported in one place.

hp-tp depends only on hp-dtensor and torch. ``hp_dtensor`` re-exports torch's DTensor, DeviceMesh
and placements (they are the same objects), so every module of this package takes them from here.
"""

from __future__ import annotations

from hp_dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    get_current_mesh,
)
from hp_dtensor.layout import Layout

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Layout",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "get_current_mesh",
]
