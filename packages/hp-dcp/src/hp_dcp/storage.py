"""Crash-safe, checksummed file-system storage in PyTorch's DCP on-disk format.

A checkpoint written here is a plain DCP directory (``.metadata`` plus ``__<rank>_<n>.distcp``
files holding ``torch.save`` blobs) that ``torch.distributed.checkpoint.FileSystemReader`` reads
as is. Two files are added next to them and ignored by PyTorch:

* ``.hp_dcp_checksums.json``: a CRC-32 per stored item (computed on the bytes as they are
  written, hardware-accelerated with ``isal``), the size of every file, and the DTensor layout
  (mesh shape, placements) of every tensor.
* while the save runs, ``.hp_dcp_incomplete``: the marker of an unfinished save.

``.metadata`` records that the checkpoint has checksums (``StorageMeta.modules`` holds
``hp_dcp.checksums``), so a checkpoint whose sidecar was deleted fails to load instead of loading
unverified. Ranks write into ``.<name>.hp-dcp-partial`` next to the target; the coordinator
publishes it with one rename (see ``hp_dcp._commit``) only after every rank reported its files
written and synced, under a lock file that stops a second save into the same path; into a
directory that also holds files no checkpoint owns, it moves the files in place instead,
``.metadata`` last, never touching the others (see ``hp_dcp._in_place``). PyTorch's stream
extensions (compression) are supported on both sides (see ``hp_dcp._extensions``).

The implementation is split by concept: ``hp_dcp._checkpoint_dir`` (file names, the checksum
sidecar, commit state), ``hp_dcp._writer`` (:class:`FileSystemWriter`), ``hp_dcp._reader``
(:class:`FileSystemReader`), ``hp_dcp._integrity`` (:func:`verify_checkpoint`),
``hp_dcp._extensions`` (stream transforms), ``hp_dcp._in_place`` (committing next to other
files); this module is their public import path.
"""

from __future__ import annotations

from hp_dcp._checkpoint_dir import (
    CHECKSUM_FILE,
    INCOMPLETE_MARKER,
    check_checkpoint_dir,
    read_checksums,
    staging_dir,
)
from hp_dcp._integrity import verify_checkpoint
from hp_dcp._reader import FileSystemReader, torch_load_tensor
from hp_dcp._writer import FileSystemWriter

__all__ = [
    "CHECKSUM_FILE",
    "INCOMPLETE_MARKER",
    "FileSystemReader",
    "FileSystemWriter",
    "check_checkpoint_dir",
    "read_checksums",
    "staging_dir",
    "torch_load_tensor",
    "verify_checkpoint",
]
