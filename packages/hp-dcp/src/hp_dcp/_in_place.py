"""Committing a checkpoint into a directory that holds other files, never touching them.

A save into a directory that is missing, empty, or holds nothing but a previous checkpoint is
published by swapping whole directories (``hp_dcp._commit.publish``). A directory that also
holds files no checkpoint owns (``model.pt`` next to a ``torch_save_to_dcp`` output, notes,
logs) cannot be swapped without moving those files, so the checkpoint is committed *in place*,
as PyTorch writes it, with the same guarantees:

1. every rank's data files are written and synced in the staging directory first, under names
   that no entry of the target has (``__<rank>_<n>.distcp``, or
   ``__<rank>_<save id>_<n>.distcp`` when the target already holds ``.distcp`` files), and
   moved into the target;
2. the checksum sidecar is replaced by one that also describes the previous checkpoint (the
   CRC-32 of its ``.metadata`` and its file checksums), so until step 3 the previous checkpoint
   still loads, verified;
3. ``.metadata`` is renamed into place last: the commit point;
4. the sidecar is rewritten without the previous checkpoint, whose data files (only those its
   metadata names) are then deleted.

Entries the checkpoints do not own are never opened, moved or deleted. An interruption before
step 3 leaves the previous checkpoint loadable; its data files (and, before step 1 finished,
the new save's) remain, unreferenced, and are never removed automatically (they are not known
to be ours once the save is gone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from hp_dcp._checkpoint_dir import (
    _MAX_METADATA_BYTES,
    _METADATA_FILE,
    _SELF_CRC,
    CHECKSUM_FILE,
    INCOMPLETE_MARKER,
    PREVIOUS_KEY,
    read_checksums,
    sidecar_text,
)
from hp_dcp._checksum import crc32
from hp_dcp._commit import publish
from hp_dcp._files import fsync_dir, read_member, write_synced
from hp_dcp._safe_pickle import load_metadata
from hp_dcp._validate import validate_metadata
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["foreign_entries", "owned_data_files", "publish_checkpoint", "publish_in_place"]

_log = logging.getLogger("hp_dcp.storage")
_BAD = (CheckpointCorruptionError, UnsafeCheckpointError, IncompleteCheckpointError, OSError)


def owned_data_files(target: Path) -> set[str]:
    """The data files the checkpoint at ``target`` names (empty when there is none or its
    ``.metadata`` cannot be read safely: then nothing but ``.metadata`` and the sidecar is
    treated as the checkpoint's own)."""
    if not (target / _METADATA_FILE).is_file():
        return set()
    source = str(target / _METADATA_FILE)
    try:
        blob = read_member(target, _METADATA_FILE, source, _MAX_METADATA_BYTES)
        metadata = validate_metadata(load_metadata(blob, source), source)
    except _BAD:
        return set()
    return {info.relative_path for info in metadata.storage_data.values()}


def foreign_entries(target: Path) -> list[str]:
    """Entries of the directory ``target`` that no checkpoint there owns."""
    owned = owned_data_files(target) | {_METADATA_FILE, CHECKSUM_FILE, f"{CHECKSUM_FILE}.tmp"}
    return sorted(name for name in os.listdir(target) if name not in owned)


def publish_checkpoint(staging: Path, target: Path, sync: bool) -> None:
    """Publish the complete checkpoint at ``staging`` at ``target``: by swapping directories
    when ``target`` holds nothing else, in place (see the module docstring) when it does."""
    if target.is_dir() and foreign_entries(target):
        publish_in_place(staging, target, sync)
    else:
        publish(staging, target, sync)


def _replace_sidecar(target: Path, data: dict[str, Any], sync: bool) -> None:
    body = dict(data)
    body.pop(_SELF_CRC, None)
    body[_SELF_CRC] = crc32(sidecar_text(body))
    tmp = target / f"{CHECKSUM_FILE}.tmp"
    write_synced(tmp, sidecar_text(body), sync)
    os.replace(tmp, target / CHECKSUM_FILE)
    if sync:
        fsync_dir(target)


def _previous(target: Path) -> dict[str, Any] | None:
    """What the sidecar must keep of the checkpoint now at ``target`` while it is replaced."""
    md = target / _METADATA_FILE
    if not md.is_file():
        return None
    blob = read_member(target, _METADATA_FILE, str(md), _MAX_METADATA_BYTES)
    try:
        sums = read_checksums(target)
    except _BAD:
        sums = None  # a damaged sidecar: the previous checkpoint was not loadable verified
    return {
        "metadata_crc32": crc32(blob),
        "files": sums["files"] if sums is not None else None,
        "layouts": sums.get("layouts", {}) if sums is not None else {},
    }


def _fresh_name(name: str, target: Path, staging: Path) -> str:
    stem = name.removesuffix(DEFAULT_SUFFIX)
    for n in itertools.count():
        candidate = f"{stem}_{uuid.uuid4().hex[:8]}{DEFAULT_SUFFIX}"
        if not os.path.lexists(target / candidate) and not os.path.lexists(staging / candidate):
            return candidate
        if n > 100:  # pragma: no cover - 32 random bits colliding a hundred times
            break
    raise FileExistsError(f"no free file name for {name} in {target}")


def _move_no_clobber(src: Path, dst: Path) -> bool:
    """Move ``src`` to ``dst`` unless ``dst`` exists (atomically where the file system has hard
    links; ``False`` when ``dst`` exists)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    except OSError:  # no hard links here (EPERM, ENOTSUP, EXDEV): check, then rename
        if os.path.lexists(dst):
            return False
        os.rename(src, dst)
        return True
    os.unlink(src)
    return True


def _rename_staged(
    staging: Path, target: Path, clashes: list[str], data_files: list[str], sync: bool
) -> list[str]:
    """Give the staged files whose names an entry of ``target`` has fresh names, rewriting the
    staged ``.metadata`` and sidecar to match (an interruption leaves the staging directory
    unverifiable, so the next save removes it: the checkpoint at ``target`` is untouched)."""
    mapping = {name: _fresh_name(name, target, staging) for name in clashes}
    source = str(staging / _METADATA_FILE)
    blob = read_member(staging, _METADATA_FILE, source, _MAX_METADATA_BYTES)
    metadata = validate_metadata(load_metadata(blob, source), source)
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=mapping[info.relative_path])
        if info.relative_path in mapping
        else info
        for index, info in metadata.storage_data.items()
    }
    sums = read_checksums(staging)
    if sums is None:
        raise IncompleteCheckpointError(f"{staging} has no {CHECKSUM_FILE}: not an hp-dcp save")
    for old, fresh in mapping.items():
        os.rename(staging / old, staging / fresh)
    new_blob = pickle.dumps(metadata)
    files = {mapping.get(name, name): entry for name, entry in sums["files"].items()}
    files[_METADATA_FILE] = {"size": len(new_blob), "crc32": crc32(new_blob)}
    write_synced(staging / _METADATA_FILE, new_blob, sync)
    _replace_sidecar(staging, {**sums, "files": files}, sync)
    _log.warning(
        "hp-dcp: %s gained entries named like this save's files since it was planned; the "
        "files were renamed %s",
        target,
        mapping,
    )
    return sorted(mapping.get(name, name) for name in data_files)


def publish_in_place(staging: Path, target: Path, sync: bool) -> None:
    """Commit the complete checkpoint at ``staging`` into ``target`` next to foreign files.

    A file of the new checkpoint whose name an entry of ``target`` has meanwhile is renamed
    first (never overwriting that entry).
    """
    new = read_checksums(staging)
    if new is None:
        raise IncompleteCheckpointError(f"{staging} has no {CHECKSUM_FILE}: not an hp-dcp save")
    data_files = sorted(
        name
        for name in os.listdir(staging)
        if name not in (_METADATA_FILE, CHECKSUM_FILE, INCOMPLETE_MARKER)
    )
    clashes = [name for name in data_files if os.path.lexists(target / name)]
    if clashes:  # (the target changed since the save was planned): never overwrite, rename
        data_files = _rename_staged(staging, target, clashes, data_files, sync)
        new = read_checksums(staging)
        assert new is not None
    old_files = owned_data_files(target)
    previous = _previous(target)
    _log.info(
        "hp-dcp: committing into %s next to %d files that are not the checkpoint's",
        target,
        len(foreign_entries(target)),
    )
    pending = list(data_files)
    while pending:  # 1. the data, under fresh names, never replacing an entry
        name = pending.pop(0)
        if not _move_no_clobber(staging / name, target / name):
            # the name was taken since the check above: give the file (and the rest) new names
            renamed = _rename_staged(staging, target, [name], [name, *pending], sync)
            pending = renamed
            new = read_checksums(staging)
            assert new is not None
    if sync:
        fsync_dir(target)
    if previous is not None:  # 2. a sidecar under which the previous checkpoint still verifies
        _replace_sidecar(target, {**new, PREVIOUS_KEY: previous}, sync)
    else:
        _replace_sidecar(target, new, sync)
    os.replace(staging / _METADATA_FILE, target / _METADATA_FILE)  # 3. the commit point
    if sync:
        fsync_dir(target)
    if previous is not None:  # 4. the sidecar of the new checkpoint alone
        _replace_sidecar(target, new, sync)
    # Only DCP data files the previous metadata names (never what a forged metadata could name).
    for name in sorted(n for n in old_files - set(data_files) if n.endswith(DEFAULT_SUFFIX)):
        with contextlib.suppress(FileNotFoundError):
            if (target / name).is_file() and not (target / name).is_symlink():
                (target / name).unlink()
    if sync:
        fsync_dir(target)
    shutil.rmtree(staging, ignore_errors=True)
