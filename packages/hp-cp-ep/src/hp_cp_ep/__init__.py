"""Context parallelism and expert parallelism.

``hp_cp_ep.cp`` holds context parallel attention (ring, Ulysses, all-gather-KV, hybrid) with
PyTorch-, HyperParallel- and TorchTitan-style fronts; ``hp_cp_ep.ep`` holds the MoE building
blocks and expert parallelism. Both public APIs are re-exported here.

See Also:
    :pt:`torch.distributed.tensor.experimental.context_parallel`
"""

from hp_cp_ep import cp as _cp
from hp_cp_ep import ep as _ep
from hp_cp_ep.__about__ import __version__
from hp_cp_ep.cp import *  # noqa: F403
from hp_cp_ep.ep import *  # noqa: F403

__all__ = ["__version__", *_cp.__all__, *_ep.__all__]
