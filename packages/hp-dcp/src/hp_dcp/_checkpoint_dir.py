"""The checkpoint directory: its file names, its sidecar of checksums, its commit state.

A committed DCP checkpoint is a directory holding ``.metadata`` and the data files it names;
hp-dcp adds the checksum sidecar ``.hp_dcp_checksums.json`` (and, while a save into a staging
directory runs, the marker ``.hp_dcp_incomplete``). This module names those files and reads and
checks the sidecar; the writer (``hp_dcp._writer``), the reader (``hp_dcp._reader``) and the
offline verifier (``hp_dcp._integrity``) share it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hp_dcp._checksum import crc32
from hp_dcp._commit import retired_dir
from hp_dcp._files import parse_json, read_member
from hp_dcp._validate import validate_sidecar
from hp_dcp.errors import CheckpointCorruptionError, IncompleteCheckpointError

__all__ = [
    "CHECKSUMS_MARKER",
    "CHECKSUM_FILE",
    "INCOMPLETE_MARKER",
    "PREVIOUS_KEY",
    "check_checkpoint_dir",
    "crc_mismatch",
    "read_checksums",
    "sidecar_text",
    "staging_dir",
]

CHECKSUM_FILE = ".hp_dcp_checksums.json"
"""Name of the sidecar file holding per-item CRC-32s, file sizes and tensor layouts."""

INCOMPLETE_MARKER = ".hp_dcp_incomplete"
"""Marker file present in a checkpoint directory while its save has not committed."""

CHECKSUMS_MARKER = "hp_dcp.checksums"
"""Entry of ``StorageMeta.modules`` in ``.metadata``: the checkpoint was saved with checksums."""

PREVIOUS_KEY = "previous"
"""Sidecar key describing the checkpoint an in-place commit is replacing (see ``_in_place``)."""

_METADATA_FILE = ".metadata"
# Upper bounds for the small files read whole (a DCP .metadata of a million items is ~200 MB).
_MAX_METADATA_BYTES = 1 << 30
_MAX_SIDECAR_BYTES = 1 << 30
_DCP_VERSION = "1.0.0"
_SIDECAR_FORMAT = "hp-dcp-checksums"
_SELF_CRC = "self_crc32"


def staging_dir(path: str | os.PathLike[str]) -> Path:
    """Return the temporary directory a save into ``path`` writes before it commits.

    Args:
        path: the checkpoint directory (the ``checkpoint_id``).

    Returns:
        ``<parent>/.<name>.hp-dcp-partial``.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemWriter`: PyTorch writes in place instead.
    """
    p = Path(path)
    return p.parent / f".{p.name}.hp-dcp-partial"


def check_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a committed checkpoint directory and return it as a ``Path``.

    Args:
        path: the checkpoint directory.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        IncompleteCheckpointError: ``path`` is the temporary directory of an unfinished save, it
            lacks ``.metadata``, or it is missing while an interrupted save left its temporary
            directory behind (the message says whether that directory is complete).
        FileNotFoundError: nothing exists at ``path``.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch's reader, which does not
        distinguish an interrupted save from a missing one.
    """
    p = Path(path)
    if (p / INCOMPLETE_MARKER).exists():
        raise IncompleteCheckpointError(
            f"{p} is the temporary directory of a save that did not finish on every rank "
            f"(it holds the marker {INCOMPLETE_MARKER}); it is not a checkpoint and is rejected. "
            "Load the last committed checkpoint instead and delete this directory."
        )
    if not p.is_dir():
        partial, retired = staging_dir(p), retired_dir(p)
        if partial.is_dir() and not (partial / INCOMPLETE_MARKER).exists():
            raise IncompleteCheckpointError(
                f"no checkpoint at {p}: a save finished on every rank but was interrupted "
                f"while renaming {partial} into place. That directory is complete; rename it to "
                f"{p} to use it"
                + (
                    f" (the previous checkpoint is still at {retired})."
                    if retired.is_dir()
                    else "."
                )
            )
        if partial.exists():
            raise IncompleteCheckpointError(
                f"no checkpoint at {p}: the save into it was interrupted before every rank "
                f"finished, leaving the incomplete temporary directory {partial}, which is "
                "rejected. Load an earlier checkpoint."
            )
        raise FileNotFoundError(f"no checkpoint at {p}: the directory does not exist")
    if not (p / _METADATA_FILE).exists():
        raise IncompleteCheckpointError(
            f"{p} holds no {_METADATA_FILE} file, so it is not a complete DCP checkpoint (a save "
            "that did not finish, or not a checkpoint directory)"
        )
    return p


def read_checksums(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read the checksum sidecar of a checkpoint directory.

    Args:
        path: the checkpoint directory.

    Returns:
        The parsed sidecar (``files``, ``layouts``, ...), or ``None`` for a checkpoint written
        without one (by PyTorch's own writer, for example).

    Raises:
        CheckpointCorruptionError: the sidecar exists but is not valid.
        UnsafeCheckpointError: the sidecar is not a regular file or names a file outside the
            checkpoint.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader.read_metadata`: PyTorch's metadata read.
    """
    root = Path(path)
    sidecar = root / CHECKSUM_FILE
    if not sidecar.exists() and not sidecar.is_symlink():
        return None
    blob = read_member(root, CHECKSUM_FILE, str(sidecar), _MAX_SIDECAR_BYTES)
    data = validate_sidecar(parse_json(blob, str(sidecar)), str(sidecar), _SIDECAR_FORMAT)
    recorded = data.pop(_SELF_CRC, None)  # absent in sidecars of hp-dcp 0.1.x
    if recorded is not None and recorded != crc32(sidecar_text(data)):
        raise CheckpointCorruptionError(
            f"checksum mismatch in {sidecar}: the checksum file itself changed after the save"
        )
    previous = data.pop(PREVIOUS_KEY, None)
    if previous is None:
        return data
    # Written only while a save commits into a directory holding other files (hp_dcp._in_place):
    # until the new .metadata lands, the previous checkpoint's one is there and must verify.
    md_blob = read_member(root, _METADATA_FILE, str(root / _METADATA_FILE), _MAX_METADATA_BYTES)
    md_crc = crc32(md_blob)
    if data["files"].get(_METADATA_FILE, {}).get("crc32") == md_crc:
        return data
    if previous["metadata_crc32"] != md_crc:
        return data  # neither: the .metadata check of the caller reports the mismatch
    if previous["files"] is None:
        return None  # the previous checkpoint had no checksums (written by PyTorch)
    return {**data, "files": previous["files"], "layouts": previous.get("layouts", {})}


def sidecar_text(data: dict[str, Any]) -> bytes:
    """The canonical text of a sidecar, which its own checksum covers."""
    return json.dumps(data, separators=(",", ":")).encode()


def crc_mismatch(file: Path, offset: int, length: int, what: str) -> CheckpointCorruptionError:
    return CheckpointCorruptionError(
        f"checksum mismatch in checkpoint file {file} (bytes {offset}..{offset + length}, "
        f"{what}): the file changed after the save committed (disk corruption or an edited "
        "or truncated copy)"
    )
