"""Allow-list unpickling of DCP metadata and byte items: loading never runs checkpoint code."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from hp_dcp.errors import UnsafeCheckpointError

_METADATA_CLASSES = frozenset(
    {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    }
)

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint._hf_utils": frozenset({"_HFStorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "range"}),
    "_codecs": frozenset({"encode"}),
}

_HOW_TO = (
    "Load it knowingly, only if you trust where it came from, with "
    "hp_dcp.load(..., allow_unsafe_pickle=True) (or "
    "hp_dcp.FileSystemReader(path, allow_unsafe_pickle=True)); or allow the specific classes "
    "with torch.serialization.safe_globals([...])."
)


def _torch_global(name: str) -> Any:
    value = getattr(torch, name, None)
    if name == "Size" or isinstance(value, torch.dtype | torch.layout | torch.memory_format):
        return value
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase | io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = _torch_global(name)
            if value is not None:
                return value
        elif name in _ALLOWED.get(module, frozenset()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._source} references the Python object {module}.{name}, which is not on "
            "hp-dcp's allow-list for checkpoint metadata (DCP metadata classes, torch dtypes, "
            f"sizes and paths); unpickling it could execute arbitrary code. {_HOW_TO}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self._source} holds a persistent id {pid!r}, which DCP metadata never contains."
        )


def load_metadata(data: bytes, source: str, *, allow_unsafe_pickle: bool) -> Any:
    """Unpickle DCP ``.metadata`` bytes with the allow-list (or plainly when allowed)."""
    if allow_unsafe_pickle:
        return pickle.loads(data)
    return _MetadataUnpickler(io.BytesIO(data), source).load()


def check_byte_item(data: bytes, key: str, source: str) -> None:
    """Raise ``UnsafeCheckpointError`` unless ``data`` loads with ``weights_only=True``.

    DCP stores non-tensor values with ``torch.save``; ``weights_only`` loading is PyTorch's
    allow-list unpickler (it honours ``torch.serialization.safe_globals``).
    """
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"checkpoint item {key!r} in {source} holds a Python object that PyTorch's "
            f"allow-list unpickler refuses ({first_line}); loading it could execute arbitrary "
            f"code. {_HOW_TO}"
        ) from exc
