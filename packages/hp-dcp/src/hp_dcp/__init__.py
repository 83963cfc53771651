"""Distributed checkpointing in PyTorch's DCP format: resharding, HF safetensors, crash safety.

See Also:
    ``torch.distributed.checkpoint``: PyTorch's distributed checkpointing.
"""

from hp_dcp.__about__ import __version__
from hp_dcp.convert import (
    CheckpointEntry,
    dcp_to_hf,
    describe_checkpoint,
    extract_tensor,
    hf_to_dcp,
)
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp.huggingface import HF_INDEX_FILE, load_hf_safetensors, save_hf_safetensors
from hp_dcp.save_load import async_save, load, save
from hp_dcp.storage import FileSystemReader, FileSystemWriter, verify_checkpoint

__all__ = [
    "HF_INDEX_FILE",
    "CheckpointCorruptionError",
    "CheckpointEntry",
    "FileSystemReader",
    "FileSystemWriter",
    "IncompleteCheckpointError",
    "UnsafeCheckpointError",
    "__version__",
    "async_save",
    "dcp_to_hf",
    "describe_checkpoint",
    "extract_tensor",
    "hf_to_dcp",
    "load",
    "load_hf_safetensors",
    "save",
    "save_hf_safetensors",
    "verify_checkpoint",
]
