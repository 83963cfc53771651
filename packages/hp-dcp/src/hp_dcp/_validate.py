"""Structural checks of DCP metadata and of hp-dcp's checksum file, before anything is read.

Every number that later decides how many bytes are read or allocated (shapes, chunk offsets and
sizes, item offsets and lengths) is checked here for type and range, and every chunk is checked
to fit in the item that stores it, so a file that lies about sizes fails with a clear error
before a byte of data is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from hp_dcp._files import check_member_name
from hp_dcp._torch_compat import StorageInfo as _StorageInfo
from hp_dcp.errors import CheckpointCorruptionError

__all__ = ["validate_metadata", "validate_sidecar"]

_MAX_DIMS = 64
# Stream transform descriptors per stored item ("stream.zstd/1"): few and short.
_MAX_TRANSFORMS = 8
_MAX_DESCRIPTOR_CHARS = 256


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _fail(source: str, what: str) -> CheckpointCorruptionError:
    return CheckpointCorruptionError(f"{source}: {what}")


def _check_shape(shape: object, source: str, what: str) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or len(shape) > _MAX_DIMS or not all(map(_is_count, shape)):
        raise _fail(source, f"{what} is {shape!r:.80}, expected a tuple of non-negative ints")
    return shape


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_tensor(key: str, md: TensorStorageMetadata, source: str) -> None:
    props = md.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(source, f"tensor {key!r} has properties {props!r:.80}, expected a dtype")
    size = _check_shape(md.size, source, f"the shape of {key!r}")
    if not isinstance(md.chunks, list):
        raise _fail(source, f"tensor {key!r} has chunks {md.chunks!r:.80}, expected a list")
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _fail(source, f"tensor {key!r} has a chunk {chunk!r:.80}")
        offsets = _check_shape(chunk.offsets, source, f"a chunk offset of {key!r}")
        sizes = _check_shape(chunk.sizes, source, f"a chunk size of {key!r}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _fail(source, f"a chunk of {key!r} has {len(sizes)} dims, the tensor {len(size)}")
        for o, s, d in zip(offsets, sizes, size, strict=True):
            if o + s > d:
                raise _fail(
                    source,
                    f"a chunk of {key!r} at {offsets} of size {sizes} exceeds its shape {size}",
                )


def _check_storage(storage: object, source: str) -> dict[MetadataIndex, _StorageInfo]:
    if not isinstance(storage, dict):
        raise _fail(source, f"the storage index is a {type(storage).__name__}, expected a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _fail(source, f"the storage index has a key {index!r:.80}")
        if not isinstance(info, _StorageInfo):
            raise _fail(source, f"item {index.fqn!r} has storage {info!r:.80}")
        check_member_name(info.relative_path, f"{source} (item {index.fqn!r})")
        if not _is_count(info.offset) or not _is_count(info.length):
            raise _fail(
                source,
                f"item {index.fqn!r} has offset {info.offset!r} and length {info.length!r}, "
                "expected non-negative ints",
            )
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, list | tuple)
            and len(descriptors) <= _MAX_TRANSFORMS
            and all(isinstance(d, str) and 0 < len(d) <= _MAX_DESCRIPTOR_CHARS for d in descriptors)
        ):
            raise _fail(
                source,
                f"item {index.fqn!r} has stream transform descriptors {descriptors!r:.120}, "
                f"expected a list of at most {_MAX_TRANSFORMS} short strings",
            )
    return storage


def validate_metadata(md: object, source: str) -> Metadata:
    """Check the types and ranges of DCP metadata; every chunk must fit in its stored item.

    Raises:
        CheckpointCorruptionError: the metadata is malformed or its sizes are inconsistent.
        UnsafeCheckpointError: a file name leaves the checkpoint directory.
    """
    if not isinstance(md, Metadata):
        raise _fail(source, f"holds a {type(md).__name__}, expected DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise _fail(source, "the state dict metadata is not a dict")
    storage = _check_storage(md.storage_data, source)
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _fail(source, f"has a non-string key {key!r:.80}")
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise _fail(source, f"item {key!r} has no stored bytes in the storage index")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise _fail(source, f"entry {key!r} is a {type(entry).__name__}")
        _check_tensor(key, entry, source)
        itemsize = entry.properties.dtype.itemsize
        covered = sum(_numel(tuple(chunk.sizes)) for chunk in entry.chunks)
        if covered < _numel(tuple(entry.size)):
            raise _fail(
                source,
                f"the chunks of {key!r} hold {covered} of its {_numel(tuple(entry.size))} "
                "elements (a shape larger than the stored data)",
            )
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise _fail(source, f"a chunk of {key!r} at {tuple(chunk.offsets)} is not stored")
            need = _numel(tuple(chunk.sizes)) * itemsize
            # A transformed (compressed) item may be smaller than its chunk; what it expands to
            # is bounded by the chunk's size when it is read (hp_dcp._extensions).
            if need > info.length and not getattr(info, "transform_descriptors", None):
                raise _fail(
                    source,
                    f"a chunk of {key!r} of shape {tuple(chunk.sizes)} needs {need} bytes, its "
                    f"stored item has {info.length}",
                )
    return md


def _check_file_entry(name: str, entry: object, source: str) -> None:
    check_member_name(name, source)
    if not isinstance(entry, dict) or not _is_count(entry.get("size")):
        raise _fail(source, f"the entry of {name!r} has no valid size")
    if "crc32" in entry and not _is_count(entry["crc32"]):
        raise _fail(source, f"the entry of {name!r} has an invalid crc32")
    items = entry.get("items", [])
    if not isinstance(items, list):
        raise _fail(source, f"the items of {name!r} are not a list")
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and all(map(_is_count, item))):
            raise _fail(source, f"{name!r} has an item record {item!r:.80}")
        if item[0] + item[1] > entry["size"]:
            raise _fail(source, f"{name!r} has an item record past its size: {item}")
    if "crc32" not in entry and not items:
        raise _fail(source, f"the entry of {name!r} has no checksum")


def validate_sidecar(data: object, source: str, expected_format: str) -> dict[str, Any]:
    """Check the structure of hp-dcp's checksum file.

    Raises:
        CheckpointCorruptionError: the file is not a well-formed hp-dcp checksum file.
        UnsafeCheckpointError: it names a file outside the checkpoint directory.
    """
    if not isinstance(data, dict) or data.get("format") != expected_format:
        raise _fail(source, "is not an hp-dcp checksum file")
    if data.get("algorithm", "crc32") != "crc32":
        raise _fail(source, f"uses the unknown checksum algorithm {data.get('algorithm')!r}")
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise _fail(source, "lists no files")
    for name, entry in files.items():
        _check_file_entry(name, entry, source)
    if not isinstance(data.get("layouts", {}), dict):
        raise _fail(source, "has layouts that are not a dict")
    previous = data.get("previous")
    if previous is not None:
        if not isinstance(previous, dict) or not _is_count(previous.get("metadata_crc32")):
            raise _fail(source, "describes a previous checkpoint without a metadata checksum")
        old_files = previous.get("files")
        if old_files is not None:
            if not isinstance(old_files, dict) or not old_files:
                raise _fail(source, "describes a previous checkpoint that lists no files")
            for name, entry in old_files.items():
                _check_file_entry(name, entry, source)
        if not isinstance(previous.get("layouts", {}), dict):
            raise _fail(source, "has previous layouts that are not a dict")
    return data
