"""Offline integrity of a committed checkpoint: every byte against its checksum.

``verify_checkpoint`` checks a whole checkpoint directory against its sidecar without loading
anything; ``saved_at`` (used when an interrupted save is recovered) reports the save time of a
complete, verified checkpoint.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from typing import Any

from hp_dcp._checkpoint_dir import (
    CHECKSUM_FILE,
    INCOMPLETE_MARKER,
    check_checkpoint_dir,
    crc_mismatch,
    read_checksums,
)
from hp_dcp._checksum import crc32
from hp_dcp._files import open_member
from hp_dcp._reader import FileSystemReader
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)

__all__ = ["saved_at", "verify_checkpoint"]


def saved_at(path: Path) -> int | None:
    """The save time of a complete, verified hp-dcp checkpoint at ``path``, else ``None``."""
    try:
        if (path / INCOMPLETE_MARKER).exists():
            return None
        verify_checkpoint(path)
        sums = read_checksums(path)
    except (CheckpointCorruptionError, IncompleteCheckpointError, UnsafeCheckpointError, OSError):
        return None
    stamp = sums.get("created_ns", 0) if sums is not None else None
    return stamp if isinstance(stamp, int) else 0


def verify_checkpoint(path: str | os.PathLike[str]) -> list[str]:
    """Verify every byte of a checkpoint against its checksum sidecar, offline.

    Args:
        path: the checkpoint directory.

    Returns:
        The names of the files verified.

    Raises:
        IncompleteCheckpointError: ``path`` is not a committed checkpoint.
        CheckpointCorruptionError: a file fails its size or checksum check, or the metadata
            records checksums whose file is missing.
        UnsafeCheckpointError: the sidecar names a file outside the checkpoint or one that is
            not a regular file.
        FileNotFoundError: the checkpoint has no checksums (written by PyTorch).

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch reads without verifying.
    """
    p = check_checkpoint_dir(path)
    sums = read_checksums(p)
    if sums is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
            FileSystemReader(p).read_metadata()  # raises if the metadata records checksums
        raise FileNotFoundError(f"{p} has no {CHECKSUM_FILE}: it was not written by hp-dcp")
    checked: list[str] = []
    for name, entry in sorted(sums["files"].items()):
        file = p / name
        fd = open_member(p, name, str(p / CHECKSUM_FILE))
        try:
            size = os.fstat(fd).st_size
            if size != entry["size"]:
                raise CheckpointCorruptionError(
                    f"checkpoint file {file} has {size} bytes, the save wrote {entry['size']}"
                )
            if size:
                _verify_file(fd, file, size, entry)
        finally:
            os.close(fd)
        checked.append(name)
    return checked


def _verify_file(fd: int, file: Path, size: int, entry: dict[str, Any]) -> None:
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            if "crc32" in entry and crc32(view) != entry["crc32"]:
                raise crc_mismatch(file, 0, size, "whole file")
            for offset, length, crc in entry.get("items", []):
                if crc32(view[offset : offset + length]) != crc:
                    raise crc_mismatch(file, offset, length, "stored item")
        finally:
            view.release()
