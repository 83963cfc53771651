"""Stream transform extensions (compression, encryption) in PyTorch's DCP on-disk format.

PyTorch's ``FileSystemWriter(_extensions=[...])`` passes every stored item through a chain of
``StreamTransformExtension`` objects (``ZStandard`` compression is built in) and records, per
item, the extensions' descriptors (``"stream.zstd/1"``, ``"<name>[@domain]/<version>"``) in the
item's storage record (``_StorageInfo.transform_descriptors``, outermost first). A reader maps
each descriptor back to an extension through an ``ExtensionRegistry`` and undoes the transforms.

hp-dcp writes the same bytes and descriptors, so either library reads what the other wrote. What
it adds on the read side: the stored (transformed) bytes are checksummed and verified before any
transform runs; the expanded stream is read in bounded pieces and refused as soon as it grows
past what the metadata allows for the item (a tensor chunk's byte size plus the ``torch.save``
archive overhead; :data:`MAX_EXPANDED_BYTE_ITEM` for a byte item), so a decompression bomb costs
at most that much memory; and what comes out goes through the same allow-list unpicklers as an
untransformed item. A descriptor the registry does not know is refused with ``ValueError``
naming it.

With several extensions, the first one given to the writer is the outermost on disk (applied
last); PyTorch 2.13's reader undoes them in the order they are recorded, which fails for more
than one non-commuting extension. hp-dcp undoes them in the order that inverts the write, so it
reads such checkpoints (PyTorch's included); with one extension (the usual case) both agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import IO, Any, cast

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from hp_dcp._tensor_blob import ViewReader
from hp_dcp._torch_compat import ExtensionRegistry
from hp_dcp.errors import CheckpointCorruptionError, UnsafeCheckpointError

__all__ = [
    "MAX_EXPANDED_BYTE_ITEM",
    "ReadTransforms",
    "WriteTransforms",
    "expanded_limit",
]

MAX_EXPANDED_BYTE_ITEM = 256 << 20
"""The most bytes a transformed byte item (a pickled non-tensor value) may expand to."""

#: Bytes a ``torch.save`` archive of one tensor adds to the tensor's storage (its pickle, zip
#: headers and directory, 64-byte alignment): a few hundred in practice, 64 KiB allowed.
_ARCHIVE_SLACK = 64 << 10
_READ_PIECE = 4 << 20
_MAX_DESCRIPTORS = 8
_MAX_DESCRIPTOR_CHARS = 256


def _check_descriptor(desc: object, where: str) -> str:
    if not isinstance(desc, str) or not desc or len(desc) > _MAX_DESCRIPTOR_CHARS:
        raise ValueError(
            f"{where}: a stream transform descriptor must be a non-empty str of at most "
            f"{_MAX_DESCRIPTOR_CHARS} characters (name[@domain]/version), got {desc!r:.80}"
        )
    return desc


class WriteTransforms:
    """The writer side: the extensions given as ``FileSystemWriter(_extensions=...)``.

    Args:
        extensions: ``None`` or a sequence of ``StreamTransformExtension`` instances (PyTorch's,
            e.g. ``ZStandard()``, or the caller's own: any object with ``get_descriptor()`` and
            ``transform_to(stream)``).

    Raises:
        TypeError: ``extensions`` is not a sequence of such objects.
        ValueError: an extension's descriptor is not a short non-empty string, or there are
            more than 8.
    """

    def __init__(self, extensions: Sequence[Any] | None) -> None:
        if extensions is None:
            extensions = ()
        if isinstance(extensions, str | bytes) or not isinstance(extensions, Sequence):
            raise TypeError(
                "FileSystemWriter(_extensions=...) takes a sequence of StreamTransformExtension "
                f"instances (e.g. [ZStandard()]), got {type(extensions).__name__}"
            )
        for ext in extensions:
            if not (
                callable(getattr(ext, "transform_to", None))
                and callable(getattr(ext, "get_descriptor", None))
            ):
                raise TypeError(
                    f"FileSystemWriter(_extensions=...) holds {ext!r:.80} "
                    f"({type(ext).__name__}), expected StreamTransformExtension instances "
                    "(objects with get_descriptor() and transform_to(stream))"
                )
        if len(extensions) > _MAX_DESCRIPTORS:
            raise ValueError(
                f"FileSystemWriter(_extensions=...) holds {len(extensions)} extensions, at most "
                f"{_MAX_DESCRIPTORS} are supported"
            )
        self.extensions: tuple[Any, ...] = tuple(extensions)
        # Recorded outermost first, as PyTorch records them: the reverse of the wrapping order.
        descriptors = [
            _check_descriptor(ext.get_descriptor(), "FileSystemWriter(_extensions=...)")
            for ext in reversed(self.extensions)
        ]
        self.descriptors: list[str] | None = descriptors or None

    def wrap(self, sink: IO[bytes]) -> IO[bytes]:
        """A stream that transforms what is written to it and writes the result to ``sink``.

        The caller closes the returned stream to flush the transforms; ``sink`` must ignore
        ``close`` (it is the checksumming view of the rank's file).
        """
        stream = sink
        for ext in self.extensions:
            stream = cast(IO[bytes], ext.transform_to(stream))
        return stream


class ReadTransforms:
    """The reader side: descriptors mapped to extensions through an ``ExtensionRegistry``.

    Args:
        registry: ``None`` (PyTorch's default registry: ``ZStandard``) or an
            ``ExtensionRegistry`` (any object with ``from_descriptor_list``) holding the
            caller's own extension classes too.

    Raises:
        TypeError: ``registry`` has no ``from_descriptor_list``.
    """

    def __init__(self, registry: Any = None) -> None:
        if registry is None:
            registry = ExtensionRegistry()
        elif not callable(getattr(registry, "from_descriptor_list", None)):
            raise TypeError(
                "FileSystemReader(_extension_registry=...) takes an ExtensionRegistry (torch."
                "distributed.checkpoint._extension.ExtensionRegistry, with your extension "
                f"classes registered), got {type(registry).__name__}"
            )
        self.registry = registry
        self._resolved: dict[tuple[str, ...], list[Any]] = {}

    def resolve(self, descriptors: Sequence[str], where: str) -> list[Any]:
        """The extensions of ``descriptors``, in the order that undoes the write.

        Raises:
            ValueError: a descriptor names an extension the registry does not know, or its
                extension cannot be built (e.g. ``zstandard`` is not installed).
        """
        key = tuple(descriptors)
        if key in self._resolved:
            return self._resolved[key]
        known = getattr(self.registry, "extensions", None)
        for desc in key:
            name = desc.partition("/")[0]
            if isinstance(known, dict) and name not in known:
                raise ValueError(
                    f"{where} was written with the stream transform {desc!r}, whose extension "
                    f"{name!r} is not in the extension registry (it knows {sorted(known)}); "
                    "register its class with ExtensionRegistry.register() and pass the registry "
                    "as FileSystemReader(path, _extension_registry=registry)"
                )
        try:
            extensions = list(self.registry.from_descriptor_list(list(key)))
        except (ValueError, KeyError, TypeError, ImportError) as exc:
            raise ValueError(
                f"{where} was written with the stream transforms {list(key)}, which cannot be "
                f"undone here: {exc}"
            ) from exc
        for desc, ext in zip(key, extensions, strict=True):
            if not callable(getattr(ext, "transform_from", None)):
                raise ValueError(
                    f"{where}: the extension of descriptor {desc!r} ({type(ext).__name__}) is "
                    "not a stream transform (it has no transform_from), so the item cannot be read"
                )
        # The writer's first extension wraps the file (it is the outermost on disk) and is
        # recorded last, so the stored bytes go through the recorded list backwards.
        ordered = list(reversed(extensions))
        self._resolved[key] = ordered
        return ordered

    def expand(
        self,
        stored: memoryview,
        descriptors: Sequence[str],
        limit: int,
        where: str,
        *,
        reserve: bool = False,
    ) -> bytearray:
        """Undo the transforms of one stored item, reading at most ``limit`` bytes of output.

        ``reserve``: read into one buffer of ``limit`` bytes (a tensor chunk, whose allowance is
        its size) instead of growing one piece by piece (a byte item's generous allowance).

        Raises:
            ValueError: see :meth:`resolve`.
            UnsafeCheckpointError: the item expands beyond ``limit`` bytes.
            CheckpointCorruptionError: the stored bytes do not decode.
        """
        stream: Any = ViewReader(stored)
        for ext in self.resolve(descriptors, where):
            stream = ext.transform_from(stream)
        try:
            if reserve and callable(getattr(stream, "readinto", None)):
                out = _read_into(stream, limit)  # one buffer of the allowance, no regrowth
            else:
                out = _read_pieces(stream, limit)
            if len(out) > limit:
                raise UnsafeCheckpointError(
                    f"{where}: its {len(stored)} stored bytes expand through the stream "
                    f"transforms {list(descriptors)} to more than {limit} bytes, the most "
                    "its metadata allows for it (a decompression bomb or a forged stream); "
                    "refused"
                )
        except (UnsafeCheckpointError, CheckpointCorruptionError):
            raise
        except Exception as exc:
            raise CheckpointCorruptionError(
                f"{where}: the stored bytes do not decode through the stream transforms "
                f"{list(descriptors)} ({type(exc).__name__}: {exc!s:.120})"
            ) from exc
        return out


def _read_into(stream: Any, limit: int) -> bytearray:
    """Read at most ``limit + 1`` bytes into one preallocated buffer."""
    buf = bytearray(limit + 1)
    view = memoryview(buf)
    n = 0
    try:
        while n <= limit:
            got = stream.readinto(view[n:])
            if not got:
                break
            n += got
    finally:
        view.release()
    del buf[n:]
    return buf


def _read_pieces(stream: Any, limit: int) -> bytearray:
    """Read at most ``limit + 1`` bytes in pieces (the allowance is too large to reserve)."""
    out = bytearray()
    while len(out) <= limit:
        piece = stream.read(min(_READ_PIECE, limit + 1 - len(out)))
        if not piece:
            break
        out += piece
    return out


def expanded_limit(
    state_dict_metadata: dict[str, Any], index: MetadataIndex, is_bytes: bool, where: str
) -> int:
    """The most bytes the stored item at ``index`` may expand to.

    A tensor item holds one chunk of the metadata (the one at ``index.offset``): its bytes plus
    the archive overhead. A byte item: :data:`MAX_EXPANDED_BYTE_ITEM`.

    Raises:
        CheckpointCorruptionError: the metadata has no such tensor chunk.
    """
    if is_bytes:
        return MAX_EXPANDED_BYTE_ITEM
    entry = state_dict_metadata.get(index.fqn)
    if isinstance(entry, TensorStorageMetadata):
        offset = tuple(index.offset) if index.offset is not None else None
        for chunk in entry.chunks:
            if offset is None or tuple(chunk.offsets) == offset:
                numel = math.prod(int(s) for s in chunk.sizes)
                return numel * entry.properties.dtype.itemsize + _ARCHIVE_SLACK
    raise CheckpointCorruptionError(
        f"{where}: the metadata has no tensor chunk at {index.offset} of {index.fqn!r}, so the "
        "size its stream transforms may expand to is unknown; refused"
    )
