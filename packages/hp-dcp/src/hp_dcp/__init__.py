"""Distributed checkpointing in PyTorch's DCP format: resharding, HF safetensors, crash safety.

See Also:
    :pt:`torch.distributed.checkpoint`: PyTorch's distributed checkpointing.
"""

from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)

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
    ConcurrentSaveError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from hp_dcp.huggingface import HF_INDEX_FILE, load_hf_safetensors, save_hf_safetensors
from hp_dcp.save_load import async_save, load, save
from hp_dcp.storage import FileSystemReader, FileSystemWriter, verify_checkpoint
from hp_dcp.verify import CheckpointStatus, VerificationReport, check_checkpoint
from hp_dtensor.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "HF_INDEX_FILE",
    "CheckpointCorruptionError",
    "CheckpointEntry",
    "CheckpointStatus",
    "ConcurrentSaveError",
    "FileSystemReader",
    "FileSystemWriter",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "IncompleteCheckpointError",
    "StateDictOptions",
    "UnsafeCheckpointError",
    "UnverifiedCheckpointWarning",
    "VerificationReport",
    "__version__",
    "async_save",
    "check_checkpoint",
    "dcp_to_hf",
    "describe_checkpoint",
    "extract_tensor",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "hf_to_dcp",
    "load",
    "load_hf_safetensors",
    "save",
    "save_hf_safetensors",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "verify_checkpoint",
]
