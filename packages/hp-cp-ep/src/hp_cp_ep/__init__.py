"""Context parallelism and expert parallelism building blocks (wave 2).

See Also:
    ``torch.distributed.tensor.experimental.context_parallel``
"""

from hp_cp_ep.__about__ import __version__

__all__ = ["__version__"]
