"""Pipeline parallelism: stages, schedules as data, one executor (wave 2).

See Also:
    ``torch.distributed.pipelining``
"""

from hp_pp.__about__ import __version__

__all__ = ["__version__"]
