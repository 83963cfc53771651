"""Opening files named by a checkpoint: confined to its directory, regular files only; fsync."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from hp_dcp.errors import CheckpointCorruptionError, UnsafeCheckpointError

__all__ = ["check_member_name", "fsync_dir", "open_member", "parse_json", "write_synced"]


def check_member_name(name: object, source: str) -> str:
    """Return ``name`` if it is a relative path that stays inside its directory.

    Raises:
        UnsafeCheckpointError: ``name`` is not a string, is empty, absolute, holds ``..`` or a
            NUL byte.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafeCheckpointError(f"{source} names the file {name!r}, which is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or ":" in name:
        raise UnsafeCheckpointError(
            f"{source} names the file {name!r}, which is outside the checkpoint directory "
            "(absolute paths and '..' are refused)"
        )
    return name


def open_member(root: Path, name: str, source: str) -> int:
    """Open ``root/name`` read-only, refusing anything but a regular file inside ``root``.

    A symbolic link is followed only if it ends inside ``root``; FIFOs, devices and sockets are
    refused without blocking (the open is non-blocking).

    Returns:
        An open file descriptor (the caller closes it).

    Raises:
        UnsafeCheckpointError: the path leaves ``root`` or is not a regular file.
        CheckpointCorruptionError: the file is missing.
    """
    check_member_name(name, source)
    path = root / name
    real_root = root.resolve()
    real = path.resolve()
    if not real.is_relative_to(real_root):
        raise UnsafeCheckpointError(
            f"{source} names {name!r}, which resolves to {real}, outside the checkpoint "
            f"directory {real_root} (a symbolic link leading out is refused)"
        )
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise CheckpointCorruptionError(f"checkpoint file {path} is missing") from exc
    except OSError as exc:
        raise CheckpointCorruptionError(f"checkpoint file {path} cannot be opened: {exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeCheckpointError(
            f"{source} names {name!r}, which is not a regular file (mode {stat.filemode(mode)}); "
            "only regular files are read"
        )
    return fd


def read_member(root: Path, name: str, source: str, limit: int) -> bytes:
    """Read a whole small member file (``.metadata``, a sidecar, an index), at most ``limit``."""
    fd = open_member(root, name, source)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointCorruptionError(
                f"{root / name} has {size} bytes, more than the {limit} such a file may have"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            # read(n) allocates n bytes up front: ask for what the file holds, not the limit
            data = f.read(size + 1)
        if len(data) > limit:
            raise CheckpointCorruptionError(
                f"{root / name} grew past {limit} bytes, more than such a file may have"
            )
        return data
    finally:
        os.close(fd)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(data: bytes, source: str) -> Any:
    """Parse JSON, refusing duplicate keys.

    Raises:
        CheckpointCorruptionError: not valid UTF-8 JSON, or a key appears twice in one object.
    """
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptionError(f"{source} is not valid JSON: {exc!s:.160}") from exc


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new, renamed or removed files) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse directory fsync
        pass
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes, sync: bool) -> None:
    """Write ``data`` to ``path`` and (``sync``) fsync it."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
