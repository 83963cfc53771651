"""Distributed checkpointing in PyTorch's DCP format, with resharding, HF safetensors and crash safety.

See Also:
    ``torch.distributed.checkpoint``: PyTorch's distributed checkpointing.
"""

from hp_dcp.__about__ import __version__
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp.save_load import async_save, load, save
from hp_dcp.storage import FileSystemReader, FileSystemWriter, verify_checkpoint

__all__ = [
    "CheckpointCorruptionError",
    "FileSystemReader",
    "FileSystemWriter",
    "IncompleteCheckpointError",
    "UnsafeCheckpointError",
    "__version__",
    "async_save",
    "load",
    "save",
    "verify_checkpoint",
]
