"""Distributed checkpointing in PyTorch's DCP format, with resharding, HF safetensors and crash safety.

See Also:
    ``torch.distributed.checkpoint``
"""

from hp_dcp.__about__ import __version__

__all__ = ["__version__"]
