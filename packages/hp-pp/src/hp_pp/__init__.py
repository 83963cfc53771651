"""Pipeline parallelism: stages, schedules as data, one executor, a validator and a simulator.

``hp_pp`` runs any schedule (a per-rank list of :class:`~hp_pp.actions.Action`) with one
executor; the schedule classes carry PyTorch's names and signatures. The planning side
(schedule generators, CSV tables, the offline validator and the simulator) needs no processes.

See Also:
    :pt:`torch.distributed.pipelining`
"""

from hp_pp import _planning_api, _runtime_api
from hp_pp.__about__ import __version__
from hp_pp._planning_api import *  # noqa: F403
from hp_pp._runtime_api import *  # noqa: F403
from hp_pp.stage import PipeliningMetadataError

__all__ = [
    "PipeliningMetadataError",
    "__version__",
    *_planning_api.__all__,
    *_runtime_api.__all__,
]
