"""Every private PyTorch name hp-dcp uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version (the checker is hp-dtensor's).
``scripts/tests/test_torch_compat.py`` lists these names.

DCP's storage records (``_StorageInfo``, ``_StoragePrefix``, HF's ``_HFStorageInfo``) appear in
``.metadata`` pickles, so the safe unpickler must allow exactly these classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_dtensor._torch_compat import missing_torch_name, require

try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
    from torch.distributed.checkpoint.filesystem import _StoragePrefix as StoragePrefix
except ImportError as _exc:  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name("hp-dcp", _exc.name or str(_exc)) from _exc

__all__ = [
    "MEM_FORMAT_ENCODING",
    "PRIVATE_NAMES",
    "Extension",
    "ExtensionRegistry",
    "HFStorageInfo",
    "StorageInfo",
    "StoragePrefix",
    "StreamTransformExtension",
    "ZStandard",
    "get_layout",
    "rebuild_tensor_v2",
]

_PACKAGE = "hp-dcp"

HFStorageInfo: type = require(_PACKAGE, "torch.distributed.checkpoint._hf_utils._HFStorageInfo")
MEM_FORMAT_ENCODING: type = require(
    _PACKAGE, "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"
)
#: ``torch.layout`` pickles as a call of this lookup by name.
get_layout: Callable[[str], Any] = require(_PACKAGE, "torch.serialization._get_layout")
#: What a pickled tensor calls to rebuild itself.
rebuild_tensor_v2: Callable[..., Any] = require(_PACKAGE, "torch._utils._rebuild_tensor_v2")

#: DCP's stream-transform extensions (compression, encryption) and their registry; the on-disk
#: descriptors name them, so hp-dcp reads and writes the same ones.
Extension: type = require(_PACKAGE, "torch.distributed.checkpoint._extension.Extension")
StreamTransformExtension: type = require(
    _PACKAGE, "torch.distributed.checkpoint._extension.StreamTransformExtension"
)
ExtensionRegistry: type = require(
    _PACKAGE, "torch.distributed.checkpoint._extension.ExtensionRegistry"
)
ZStandard: type = require(_PACKAGE, "torch.distributed.checkpoint._extension.ZStandard")

PRIVATE_NAMES = (
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.filesystem._StoragePrefix",
    "torch.distributed.checkpoint._hf_utils._HFStorageInfo",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.serialization._get_layout",
    "torch._utils._rebuild_tensor_v2",
    "torch.distributed.checkpoint._extension.Extension",
    "torch.distributed.checkpoint._extension.StreamTransformExtension",
    "torch.distributed.checkpoint._extension.ExtensionRegistry",
    "torch.distributed.checkpoint._extension.ZStandard",
)
