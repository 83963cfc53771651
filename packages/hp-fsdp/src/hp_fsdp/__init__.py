"""A drop-in replacement for PyTorch FSDP2 (`fully_shard`) with its own runtime.

See Also:
    ``torch.distributed.fsdp.fully_shard``: PyTorch's FSDP2 API.
"""

from hp_fsdp.__about__ import __version__
from hp_fsdp.api import FSDPModule, HSDPModule, UnshardHandle, fully_shard
from hp_fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "__version__",
    "fully_shard",
]
