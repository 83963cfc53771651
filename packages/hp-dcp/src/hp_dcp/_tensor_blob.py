"""Zero-copy decoding of one ``torch.save``'d tensor from a (memory-mapped) buffer.

DCP stores every tensor chunk as a ``torch.save`` zip archive: ``data.pkl`` (a tiny pickle that
calls ``torch._utils._rebuild_tensor_v2`` on a persistent storage id) plus the raw storage bytes
as an uncompressed record. Decoding it here views the storage bytes in place (no copy), so a
load copies each byte once, from the page cache into the destination tensor. The pickle is read
with hp-dcp's safe unpickler and a three-name allow-list (the rebuild function, the
typed-storage classes, ``OrderedDict``);
anything else, a big-endian archive, or a misaligned record returns ``None`` and the caller
falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import sys
import uuid
import warnings
import zipfile
import zlib
from collections import OrderedDict
from typing import Any

import torch

from hp_dcp._safe_pickle import AllowList, SafeUnpickler
from hp_dcp._torch_compat import rebuild_tensor_v2
from hp_dcp.errors import CheckpointCorruptionError, UnsafeCheckpointError

_LOCAL_HEADER = b"PK\x03\x04"


class _UnsupportedBlobError(Exception):
    """The blob is not the plain single-tensor layout this fast path understands."""


class ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview (``zipfile`` reads only the directory)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class _StorageKind:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild(
    storage: tuple[torch.UntypedStorage, torch.dtype],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    if backward_hooks or metadata:
        raise _UnsupportedBlobError("tensor with hooks or python attributes")
    untyped, dtype = storage
    return torch.empty(0, dtype=dtype).set_(untyped, storage_offset, size, stride)


def _storage_kinds() -> dict[str, _StorageKind]:
    kinds = {"torch.UntypedStorage": _StorageKind(torch.uint8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage classes warn on attribute access
        for name in dir(torch):
            dtype = (
                getattr(getattr(torch, name, None), "dtype", None)
                if name.endswith("Storage")
                else None
            )
            if isinstance(dtype, torch.dtype):
                kinds[f"torch.{name}"] = _StorageKind(dtype)
    return kinds


_TENSOR_ALLOW_LIST = AllowList(
    globals={
        "torch._utils._rebuild_tensor_v2": _rebuild,
        "collections.OrderedDict": OrderedDict,
        **_storage_kinds(),
    },
    constructors=frozenset({_rebuild, OrderedDict}),
    classes=frozenset(),
)


class _StorageRecords:
    """Resolves the pickle's persistent storage ids to records of the archive, in place."""

    def __init__(self, records: dict[str, memoryview]) -> None:
        self._records = records

    def __call__(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _UnsupportedBlobError("unexpected persistent id")
        kind, key, _location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(kind, _StorageKind) or not isinstance(numel, int):
            raise _UnsupportedBlobError("unexpected storage type")
        record = self._records.get(f"data/{key}")
        itemsize = torch.empty((), dtype=kind.dtype).element_size()
        if record is None or len(record) != numel * itemsize:
            raise _UnsupportedBlobError("storage record missing or of the wrong size")
        if len(record) == 0:
            return torch.empty(0, dtype=torch.uint8).untyped_storage(), kind.dtype
        raw = torch.frombuffer(record, dtype=torch.uint8)
        if raw.data_ptr() % itemsize:
            raise _UnsupportedBlobError("misaligned storage record")
        return raw.untyped_storage(), kind.dtype


def decode_tensor(blob: memoryview) -> torch.Tensor | None:
    """Decode a ``torch.save``'d tensor viewing ``blob`` in place, or return ``None``.

    ``blob`` must stay alive (and unmodified) while the returned tensor is used; it must be
    writable (an ``ACCESS_COPY`` mmap) for ``torch.frombuffer``.
    """
    try:
        zf = zipfile.ZipFile(ViewReader(blob))
        records: dict[str, memoryview] = {}
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise _UnsupportedBlobError("compressed record")
            off = info.header_offset
            header = blob[off : off + 30]
            if header[:4] != _LOCAL_HEADER:
                raise _UnsupportedBlobError("bad local header")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = off + 30 + name_len + extra_len
            _, _, short = info.filename.partition("/")
            records[short] = blob[start : start + info.file_size]
        order = records.get("byteorder")
        if order is not None and bytes(order) != sys.byteorder.encode():
            raise _UnsupportedBlobError("foreign byte order")
        pkl = records.get("data.pkl")
        if pkl is None:
            raise _UnsupportedBlobError("no data.pkl")
        obj = SafeUnpickler(
            bytes(pkl), "tensor pickle", _TENSOR_ALLOW_LIST, _StorageRecords(records)
        ).load()
    except (
        _UnsupportedBlobError,
        UnsafeCheckpointError,
        CheckpointCorruptionError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        struct.error,
        EOFError,
        RuntimeError,  # e.g. sizes/strides out of the storage's bounds: torch refuses the view
        ValueError,
    ):
        return None
    return obj if type(obj) is torch.Tensor else None


# --- encoding ---------------------------------------------------------------------------------

_STORAGE_NAMES = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}
_RECORD_ALIGN = 64
_ZIP32_MAX = 0xFFFFFFFF - (1 << 16)
_DOS_DATE = 0x21  # 1980-01-01


class _StorageRef:
    """Pickled as torch.save's persistent storage id."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype = dtype
        self.numel = numel


class _TensorRef:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> tuple[Any, ...]:
        t = self.t
        ref = _StorageRef(t.dtype, t.untyped_storage().nbytes() // t.element_size())
        args: tuple[Any, ...] = (ref, t.storage_offset(), tuple(t.size()), t.stride(), False)
        args += (OrderedDict(),)
        return (rebuild_tensor_v2, args)


class _TensorPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", getattr(torch, _STORAGE_NAMES[obj.dtype]), "0", "cpu", obj.numel)
        return None


def can_encode(t: torch.Tensor) -> bool:
    """Whether :func:`encode_tensor` handles ``t`` (else use ``torch.save``)."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.dtype in _STORAGE_NAMES
        and not t.requires_grad
        and t.untyped_storage().nbytes() == t.nbytes
        and t.nbytes < _ZIP32_MAX
    )


def _storage_view(t: torch.Tensor) -> memoryview:
    n = t.untyped_storage().nbytes()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.untyped_storage().data_ptr())).cast("B")


def encode_tensor(t: torch.Tensor, write: Any) -> None:
    """Write ``t`` as a ``torch.save`` archive (loadable by ``torch.load``) through ``write``.

    The archive has the records torch.save writes (``data.pkl``, ``byteorder``, the storage as
    ``data/0``, ``version``, ...), uncompressed and 64-byte aligned relative to its start. The
    storage bytes are handed to ``write`` in place (no copy). Its zip CRC field is left 0, as
    torch.save writes it with ``compute_crc32`` off; hp-dcp checksums every item itself.
    ``t`` must satisfy :func:`can_encode`.
    """
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=2).dump(_TensorRef(t))
    records: list[tuple[str, Any, bool]] = [
        ("data.pkl", buf.getvalue(), True),
        (".format_version", b"1", True),
        (".storage_alignment", b"64", True),
        ("byteorder", sys.byteorder.encode(), True),
        ("data/0", _storage_view(t), False),
        ("version", b"3\n", True),
        (".data/serialization_id", uuid.uuid4().hex.encode().ljust(40, b"0"), True),
    ]
    pos = 0
    central: list[bytes] = []
    for short, data, small in records:
        name = f"archive/{short}".encode()
        size = len(data)
        crc = zlib.crc32(data) if small else 0
        header_end = pos + 30 + len(name) + 4
        pad = -header_end % _RECORD_ALIGN
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        local = (
            struct.pack(
                "<4sHHHHHIIIHH",
                _LOCAL_HEADER,
                20,
                0,
                0,
                0,
                _DOS_DATE,
                crc,
                size,
                size,
                len(name),
                len(extra),
            )
            + name
            + extra
        )
        central.append(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                20,
                20,
                0,
                0,
                0,
                _DOS_DATE,
                crc,
                size,
                size,
                len(name),
                0,
                0,
                0,
                0,
                0,
                pos,
            )
            + name
        )
        write(local)
        if size:
            write(data)
        pos += len(local) + size
    directory = b"".join(central)
    end = struct.pack(
        "<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(records), len(records), len(directory), pos, 0
    )
    write(directory + end)
