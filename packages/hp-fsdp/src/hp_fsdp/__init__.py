"""A drop-in replacement for PyTorch FSDP2 (`fully_shard`) with its own runtime.

See Also:
    ``torch.distributed.fsdp.fully_shard``
"""

from hp_fsdp.__about__ import __version__

__all__ = ["__version__"]
