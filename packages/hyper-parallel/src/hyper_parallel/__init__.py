"""The full hyper-parallel stack under one import.

``hyper_parallel`` re-exports the public API of every component package. Names are unique across
the stack; where two packages share a helper (the state-dict helpers live in ``hp_dtensor`` and are
re-exported by ``hp_fsdp`` and ``hp_dcp``) the objects are identical.

See Also:
    :pt:`torch.distributed`: the substrate every component builds on.
"""

from hyper_parallel.__about__ import __version__
from hyper_parallel._reexport import collect_public_api

_api = collect_public_api()
globals().update(_api)

__all__ = ["__version__", *sorted(_api)]
