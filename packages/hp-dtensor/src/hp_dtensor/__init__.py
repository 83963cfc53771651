"""DTensor substrate: torch's DTensor/DeviceMesh re-exported, Layout, mesh context, device layer, sharded initialization, state-dict helpers and the distributed test harness.

See Also:
    ``torch.distributed.tensor``
"""

from hp_dtensor.__about__ import __version__

__all__ = ["__version__"]
