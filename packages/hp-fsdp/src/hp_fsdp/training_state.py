"""Where a unit is in the iteration (forward, pre-backward, post-backward, idle).

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState`.
"""

from __future__ import annotations

import enum

__all__ = ["TrainingState"]


class TrainingState(enum.Enum):
    """Where a unit is in the iteration.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState`: PyTorch's enum.
    """

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()
