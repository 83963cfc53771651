"""The DTensor names hp-tp builds on, imported in one place.

hp-tp depends only on hp-dtensor and torch. ``hp_dtensor`` re-exports torch's DTensor, DeviceMesh
and placements (they are the same objects), so every module of this package takes them from here.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from hp_dtensor.mesh import get_current_mesh

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "get_current_mesh",
]
