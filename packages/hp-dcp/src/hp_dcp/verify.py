"""Offline integrity report of a checkpoint: complete, verified, unverified, corrupt or unsafe.

:func:`check_checkpoint` reads a DCP checkpoint (or a HuggingFace safetensors directory) the way
a load would, without a state dict: metadata through the safe unpickler, every file confined and
size-checked, every checksum compared, every item decoded through the safe unpicklers. It
stops at the first problem and names the file and the item.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import warnings
from enum import Enum
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from hp_dcp._checksum import crc32
from hp_dcp._extensions import ReadTransforms, expanded_limit
from hp_dcp._files import open_member
from hp_dcp._safe_pickle import load_byte_item
from hp_dcp._tensor_blob import decode_tensor
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from hp_dcp.huggingface import HF_INDEX_FILE, HFCheckpointFiles
from hp_dcp.storage import (
    CHECKSUM_FILE,
    FileSystemReader,
    check_checkpoint_dir,
    read_checksums,
    torch_load_tensor,
)

__all__ = ["CheckpointStatus", "VerificationReport", "check_checkpoint"]


class CheckpointStatus(Enum):
    """The verdict of :func:`check_checkpoint`; ``value`` is the ``hp-dcp verify`` exit code.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch has no such check.
    """

    VERIFIED = 0
    """Complete, and every byte matches the checksums recorded when it was saved."""
    UNVERIFIED = 2
    """Complete and readable, but carries no checksums (written by PyTorch or another tool)."""
    CORRUPT = 3
    """A file is missing, truncated, changed, or not what the metadata says."""
    INCOMPLETE = 4
    """The directory is not a committed checkpoint (an interrupted save, or no ``.metadata``)."""
    UNSAFE = 5
    """Loading would need code from the checkpoint, or a path leaves the directory."""


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    """What :func:`check_checkpoint` found.

    Attributes:
        path: the checkpoint directory.
        status: the verdict.
        files: the files checked before the verdict (all of them when it is good).
        items: the number of stored items decoded.
        bad_file: the first file found bad (``None`` when good).
        bad_item: the first item found bad, if the problem is in one item.
        message: a one-line explanation.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch has no such check.
    """

    path: Path
    status: CheckpointStatus
    files: tuple[str, ...] = ()
    items: int = 0
    bad_file: str | None = None
    bad_item: str | None = None
    message: str = ""


_STATUS_OF = {
    IncompleteCheckpointError: CheckpointStatus.INCOMPLETE,
    UnsafeCheckpointError: CheckpointStatus.UNSAFE,
    CheckpointCorruptionError: CheckpointStatus.CORRUPT,
}
_FAILURES = (IncompleteCheckpointError, UnsafeCheckpointError, CheckpointCorruptionError)


class _Checker:
    """Walks one checkpoint; ``fail`` turns the first error into the report."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[str] = []
        self.items = 0
        self._transforms = ReadTransforms()
        self._transformed: dict[tuple[str, int, int], tuple[list[str], MetadataIndex]] = {}

    def fail(self, exc: BaseException, file: str | None, item: str | None) -> VerificationReport:
        status = next(s for cls, s in _STATUS_OF.items() if isinstance(exc, cls))
        file = getattr(exc, "file", None) or file
        item = getattr(exc, "item", None) or item
        return VerificationReport(
            self.root, status, tuple(self.files), self.items, file, item, str(exc)
        )

    def good(self, status: CheckpointStatus, message: str) -> VerificationReport:
        return VerificationReport(
            self.root, status, tuple(self.files), self.items, None, None, message
        )

    def dcp(self) -> VerificationReport:
        try:
            check_checkpoint_dir(self.root)
        except IncompleteCheckpointError as exc:
            return self.fail(exc, None, None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
                md = FileSystemReader(self.root).read_metadata()
            sums = read_checksums(self.root)
        except _FAILURES as exc:
            bad = CHECKSUM_FILE if CHECKSUM_FILE in str(exc) else ".metadata"
            return self.fail(exc, bad, None)
        self.files.append(".metadata")
        entries = dict(sums["files"]) if sums is not None else {}
        entries.pop(".metadata", None)
        per_file = _items_per_file(md)
        self._transformed = {
            (info.relative_path, info.offset, info.length): (list(descriptors), index)
            for index, info in md.storage_data.items()
            if (descriptors := getattr(info, "transform_descriptors", None))
        }
        for name in sorted(set(per_file) | set(entries)):
            items = per_file.get(name, [])
            entry = entries.get(name)
            try:
                if sums is not None and entry is None:
                    raise CheckpointCorruptionError(
                        f"{self.root / name} is not listed in {CHECKSUM_FILE}"
                    )
                bad_item = self._file(name, items, entry, md)
            except _FAILURES as exc:
                return self.fail(exc, name, None)
            if bad_item is not None:
                return bad_item
            self.files.append(name)
        if sums is None:
            return self.good(
                CheckpointStatus.UNVERIFIED,
                f"complete: {len(self.files)} files, {self.items} items readable; no checksums "
                "(written by PyTorch or another tool), so corruption cannot be detected",
            )
        return self.good(
            CheckpointStatus.VERIFIED,
            f"verified: {len(self.files)} files, {self.items} items match their checksums",
        )

    def _file(
        self,
        name: str,
        items: list[tuple[int, int, str]],
        entry: dict[str, Any] | None,
        md: Metadata,
    ) -> VerificationReport | None:
        first = items[0][2] if items else None
        fd = open_member(self.root, name, str(self.root / ".metadata"))
        try:
            size = os.fstat(fd).st_size
            if entry is not None and size != entry["size"]:
                raise CheckpointCorruptionError(
                    f"{self.root / name} has {size} bytes, the save wrote {entry['size']}"
                )
            for offset, length, fqn in items:
                if offset + length > size:
                    err = CheckpointCorruptionError(
                        f"item {fqn!r} of {self.root / name} ends at byte {offset + length}, "
                        f"the file has {size}"
                    )
                    return self.fail(err, name, fqn)
            if size == 0:
                return None
            with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as mm:
                view = memoryview(mm)
                try:
                    return self._contents(name, view, items, entry, md, first)
                finally:
                    view.release()
        finally:
            os.close(fd)

    def _contents(
        self,
        name: str,
        view: memoryview,
        items: list[tuple[int, int, str]],
        entry: dict[str, Any] | None,
        md: Metadata,
        first: str | None,
    ) -> VerificationReport | None:
        path = self.root / name
        owner = {offset: fqn for offset, _, fqn in items}
        if entry is not None:
            if "crc32" in entry and crc32(view) != entry["crc32"]:
                err = CheckpointCorruptionError(f"checksum mismatch in {path} (whole file)")
                return self.fail(err, name, first)
            for offset, length, crc in entry.get("items", []):
                if crc32(view[offset : offset + length]) != crc:
                    fqn = owner.get(offset)
                    err = CheckpointCorruptionError(
                        f"checksum mismatch in {path} (bytes {offset}..{offset + length}"
                        + (f", item {fqn!r})" if fqn else ")")
                    )
                    return self.fail(err, name, fqn)
        for offset, length, fqn in items:
            blob = view[offset : offset + length]
            try:
                is_bytes = isinstance(md.state_dict_metadata.get(fqn), BytesStorageMetadata)
                transformed = self._transformed.get((name, offset, length))
                if transformed is not None:
                    blob = self._expand(blob, transformed, md, is_bytes, f"item {fqn!r} in {path}")
                if is_bytes:
                    load_byte_item(bytes(blob), fqn, str(path))
                else:
                    tensor = decode_tensor(blob)
                    if tensor is None:
                        tensor = torch_load_tensor(blob, path, fqn)
                    del tensor
            except _FAILURES as exc:
                return self.fail(exc, name, fqn)
            finally:
                blob.release()
            self.items += 1
        return None

    def _expand(
        self,
        blob: memoryview,
        transformed: tuple[list[str], MetadataIndex],
        md: Metadata,
        is_bytes: bool,
        where: str,
    ) -> memoryview:
        """The item's bytes with its stream transforms undone (PyTorch's built-in ones)."""
        descriptors, index = transformed
        limit = expanded_limit(md.state_dict_metadata, index, is_bytes, where)
        try:
            expanded = self._transforms.expand(
                blob, descriptors, limit, where, reserve=not is_bytes
            )
        except ValueError as exc:  # an extension this process does not have: cannot be read
            raise UnsafeCheckpointError(str(exc)) from exc
        finally:
            blob.release()
        return memoryview(expanded)

    def hf(self) -> VerificationReport:
        try:
            ckpt = HFCheckpointFiles(self.root)
        except _FAILURES as exc:
            return self.fail(exc, HF_INDEX_FILE, None)
        except FileNotFoundError as exc:
            return self.fail(CheckpointCorruptionError(str(exc)), HF_INDEX_FILE, None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
                ckpt.check_unverified()
        except _FAILURES as exc:
            return self.fail(exc, HF_INDEX_FILE, None)
        for name in sorted(ckpt.files):
            try:
                ckpt.verify(name)
                ckpt.header(name)
            except _FAILURES as exc:
                return self.fail(exc, name, None)
            self.files.append(name)
            self.items += len(ckpt.files[name])
        if ckpt.sums is None:
            return self.good(
                CheckpointStatus.UNVERIFIED,
                f"complete: {len(self.files)} safetensors files; no checksums (not written by "
                "hp-dcp)",
            )
        return self.good(
            CheckpointStatus.VERIFIED,
            f"verified: {len(self.files)} safetensors files match their checksums",
        )


def _items_per_file(md: Metadata) -> dict[str, list[tuple[int, int, str]]]:
    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in md.storage_data.items():
        out.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for items in out.values():
        items.sort()
    return out


def check_checkpoint(path: str | os.PathLike[str]) -> VerificationReport:
    """Check a checkpoint offline and report its status, naming the first bad file and item.

    Reads a DCP checkpoint (written by hp-dcp or PyTorch) or a HuggingFace safetensors directory
    as a load would, without a state dict or a process group: the metadata through the safe
    unpickler, every file confined to the directory and size-checked, every checksum compared,
    every stored item decoded through the safe unpicklers.

    Args:
        path: the checkpoint directory.

    Returns:
        The report; ``report.status.value`` is the exit code of ``hp-dcp verify``.

    Raises:
        FileNotFoundError: nothing exists at ``path``.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch reads without verifying.
        :pt:`torch.load` (``weights_only=True``): PyTorch's allow-list loading.
    """
    root = Path(path)
    checker = _Checker(root)
    is_hf = (
        root.is_dir()
        and not (root / ".metadata").exists()
        and ((root / HF_INDEX_FILE).exists() or any(root.glob("*.safetensors")))
    )
    return checker.hf() if is_hf else checker.dcp()
