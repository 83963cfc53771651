"""Context parallelism and expert parallelism.

``hp_cp_ep.cp`` holds context parallel attention (ring, Ulysses, all-gather-KV, hybrid) with
PyTorch-, HyperParallel- and TorchTitan-style fronts; ``hp_cp_ep.dsa`` DeepSeek sparse attention
and its context parallelism; ``hp_cp_ep.ep`` holds the MoE building blocks and expert
parallelism. Their public APIs are re-exported here.

See Also:
    :pt:`torch.distributed.tensor.experimental.context_parallel`
"""

from hp_cp_ep import cp as _cp
from hp_cp_ep import dsa as _dsa
from hp_cp_ep import ep as _ep
from hp_cp_ep.__about__ import __version__
from hp_cp_ep.cp import *  # noqa: F403
from hp_cp_ep.dsa import *  # noqa: F403
from hp_cp_ep.ep import *  # noqa: F403

__all__ = ["__version__", *_cp.__all__, *_dsa.__all__, *_ep.__all__]
