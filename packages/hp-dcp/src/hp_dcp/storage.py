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
written and synced, under a lock file that stops a second save into the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import logging
import mmap
import os
import pickle
import time
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from hp_dcp._checksum import crc32
from hp_dcp._commit import SaveLock, publish, recover_leftovers, retired_dir
from hp_dcp._files import fsync_dir, open_member, parse_json, read_member, write_synced
from hp_dcp._safe_pickle import load_byte_item, load_metadata, weights_only_error
from hp_dcp._tensor_blob import can_encode, decode_tensor, encode_tensor
from hp_dcp._torch_compat import StorageInfo as _StorageInfo
from hp_dcp._torch_compat import StoragePrefix as _StoragePrefix
from hp_dcp._validate import validate_metadata, validate_sidecar
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)

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

CHECKSUM_FILE = ".hp_dcp_checksums.json"
"""Name of the sidecar file holding per-item CRC-32s, file sizes and tensor layouts."""

INCOMPLETE_MARKER = ".hp_dcp_incomplete"
"""Marker file present in a checkpoint directory while its save has not committed."""

CHECKSUMS_MARKER = "hp_dcp.checksums"
"""Entry of ``StorageMeta.modules`` in ``.metadata``: the checkpoint was saved with checksums."""

_METADATA_FILE = ".metadata"
# Upper bounds for the small files read whole (a DCP .metadata of a million items is ~200 MB).
_MAX_METADATA_BYTES = 1 << 30
_MAX_SIDECAR_BYTES = 1 << 30
_DCP_VERSION = "1.0.0"
_SIDECAR_FORMAT = "hp-dcp-checksums"
_SELF_CRC = "self_crc32"
_RESULT_KEY = "\x00hp_dcp_file_checksums"
# Items start at multiples of this, so the (64-byte aligned) tensor records inside each
# torch.save archive are aligned in the file, and in a memory map of it.
_ALIGN = 64
_DEFAULT_COPY_AHEAD = 10_000_000
_log = logging.getLogger(__name__)


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
    if recorded is not None and recorded != crc32(_sidecar_text(data)):
        raise CheckpointCorruptionError(
            f"checksum mismatch in {sidecar}: the checksum file itself changed after the save"
        )
    return data


def _sidecar_text(data: dict[str, Any]) -> bytes:
    """The canonical text of a sidecar, which its own checksum covers."""
    return json.dumps(data, separators=(",", ":")).encode()


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


class _ChecksumStream(io.RawIOBase):
    """A write-only stream computing a running CRC-32 of everything written through it."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = crc32(view, self.crc)
        written = self._raw.write(view)
        return view.nbytes if written is None else written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:  # the underlying file is closed by its owner
        pass


def _split_into_buckets(count: int, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
    if count == 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    byte_items = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
    tensor_items = [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
    for i, wi in enumerate(byte_items):
        buckets[i % count].append(wi)
    tensor_items.sort(key=_item_nbytes, reverse=True)
    for wi in tensor_items:
        idx = sizes.index(min(sizes))
        buckets[idx].append(wi)
        sizes[idx] += _item_nbytes(wi)
    return buckets


def _item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    return int(torch.Size(td.size).numel()) * torch.empty((), dtype=td.properties.dtype).itemsize


def _layouts_of(planner: SavePlanner) -> dict[str, Any]:
    flat = getattr(planner, "state_dict", None)
    layouts: dict[str, Any] = {}
    if not isinstance(flat, dict):
        return layouts
    for key, value in flat.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            layouts[str(key)] = {
                "mesh_shape": list(mesh.shape),
                "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                "placements": [repr(p) for p in value.placements],
            }
    return layouts


class FileSystemWriter(StorageWriter, BlockingAsyncStager):
    """Crash-safe DCP storage writer: checksums while writing, commits by directory rename.

    Drop-in for ``torch.distributed.checkpoint.FileSystemWriter`` (same arguments and
    defaults) and writes the same on-disk format, so torch DCP loads what it saves. What it adds:

    * every rank writes into ``.<name>.hp-dcp-partial``; the coordinator writes ``.metadata``
      and the checksum sidecar and renames the directory to ``path`` only after all ranks
      finished, so a crash mid-save leaves the previous checkpoint at ``path`` untouched;
    * a CRC-32 of every stored item, computed on the bytes as they are written, verified by
      :class:`FileSystemReader`; plain CPU tensors are encoded as ``torch.save`` archives by
      hp-dcp itself (same format, storage bytes written in place, one checksum pass instead of
      torch's zip CRC), anything else through ``torch.save``;
    * the DTensor layout of every tensor in the sidecar (``hp-dcp inspect`` shows it).

    An existing checkpoint at ``path`` is replaced as a whole directory (``overwrite=True``);
    a non-empty directory that is not a DCP checkpoint is never replaced. All ranks must see
    the same file system (as for loading any multi-rank DCP checkpoint).

    Args:
        path: the checkpoint directory.
        single_file_per_rank: one file per rank (per writer thread); ``False`` writes one file
            per item.
        sync_files: ``fsync`` every file (and the directories) before committing. Without it a
            power loss may leave a committed but incomplete checkpoint.
        thread_count: number of writer threads per rank, each writing its own file.
        per_thread_copy_ahead: a hint (logged at debug level when changed): tensors are copied
            to host memory one item at a time right before they are written, so no copy-ahead
            budget applies.
        cache_staged_state_dict: keep the host copy made by ``async_save`` staging for reuse.
        overwrite: replace an existing checkpoint at ``path``; ``False`` raises instead.
        _extensions: stream transforms are not supported; must be ``None`` or empty.
        serialization_format: only ``SerializationFormat.TORCH_SAVE`` (the format PyTorch's
            reader loads); use ``HuggingFaceStorageWriter`` for safetensors.

    Raises:
        ValueError: an unsupported ``_extensions``, ``serialization_format`` or
            ``thread_count`` was given.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemWriter`: PyTorch's file-system writer.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = _DEFAULT_COPY_AHEAD,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
    ) -> None:
        if _extensions:
            raise ValueError(
                f"hp_dcp.FileSystemWriter does not support stream transform extensions; got "
                f"{list(_extensions)!r}, expected None"
            )
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(
                f"hp_dcp.FileSystemWriter writes SerializationFormat.TORCH_SAVE only (the format "
                f"torch's FileSystemReader loads); got {serialization_format!r}. Use "
                "hp_dcp.HuggingFaceStorageWriter for safetensors files."
            )
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.fs = FileSystem()
        self.path = Path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        if per_thread_copy_ahead != _DEFAULT_COPY_AHEAD:
            _log.debug(
                "FileSystemWriter(per_thread_copy_ahead=%d) is a hint hp-dcp does not use: "
                "tensors are copied to host memory one item at a time as they are written",
                per_thread_copy_ahead,
            )
        self.overwrite = overwrite
        self.serialization_format = serialization_format
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = False
        self._lock: SaveLock | None = None

    def abort(self) -> None:
        """Release the save lock after a failed save (no-op when this writer holds none).

        :func:`hp_dcp.save` calls it when a save fails; call it yourself when driving the writer
        through ``torch.distributed.checkpoint.save``. A lock left by a process that died is
        detected and taken over by the next save anyway.

        See Also:
            :pt:`torch.distributed.checkpoint.FileSystemWriter`: PyTorch's writer has no lock.
        """
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Point the writer at a new checkpoint and start a new save.

        Args:
            checkpoint_id: the new checkpoint directory; ``None`` keeps the current one.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.reset`: the interface method.
        """
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role.

        Args:
            is_coordinator: whether this rank commits the checkpoint.
            *args: unused.
            **kwargs: ``rank`` and ``use_collectives`` as passed by DCP.

        Raises:
            ValueError: ``use_collectives=False``: the commit needs every rank's results.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.set_up_storage_writer`.
        """
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "hp_dcp.FileSystemWriter needs use_collectives=True: the checkpoint is committed "
                "only after the coordinator has every rank's write results. Pass "
                "torch.distributed.checkpoint.FileSystemWriter to save without coordination."
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return the local plan unchanged.

        Args:
            plan: the planner's local plan.

        Returns:
            ``plan``.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.prepare_local_plan`.
        """
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: refuse a forbidden overwrite, create the staging directory.

        Args:
            plans: every rank's local plan.

        Returns:
            The plans, each given the file prefix ``__<rank>_``.

        Takes the save lock of ``path``, then inspects what an interrupted save may have left:
        a complete staging directory is published (recovered), an incomplete one removed, each
        with a log line.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite=False``, or ``path`` is a non-empty
                directory that is not a DCP checkpoint.
            ConcurrentSaveError: another save into ``path`` holds the lock.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.prepare_global_plan`.
        """
        self._check_target()
        lock = SaveLock(self.path, self.save_id)
        lock.acquire()
        self._lock = lock
        try:
            staging = staging_dir(self.path)
            recover_leftovers(self.path, staging, saved_at, self.sync_files)
            self._check_target()
            staging.mkdir(parents=True)
            write_synced(
                staging / INCOMPLETE_MARKER,
                f"save {self.save_id} in progress\n".encode(),
                self.sync_files,
            )
            if self.sync_files:
                fsync_dir(staging.parent)
        except BaseException:
            self.abort()
            raise
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def _check_target(self) -> None:
        p = self.path
        if not p.exists():
            return
        if not self.overwrite:
            raise FileExistsError(f"a checkpoint already exists at {p} and overwrite=False")
        if not p.is_dir():
            raise FileExistsError(f"{p} exists and is not a directory; refusing to replace it")
        is_checkpoint = (p / _METADATA_FILE).exists() or (p / CHECKSUM_FILE).exists()
        if not is_checkpoint and any(p.iterdir()):
            raise FileExistsError(
                f"{p} is a non-empty directory without a DCP .metadata file; hp-dcp replaces a "
                "checkpoint directory as a whole and refuses to replace anything else"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into the staging directory, checksumming as it goes.

        Args:
            plan: the final local plan (its ``storage_data`` holds the file prefix).
            planner: resolves each write item to a tensor or a byte buffer.

        Returns:
            A completed future with one ``WriteResult`` per item plus one carrying this rank's
            checksums to the coordinator.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.write_data`.
        """
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        staging = staging_dir(self.path)
        if self.single_file_per_rank:
            buckets = [b for b in _split_into_buckets(self.thread_count, plan.items) if b]
        else:
            buckets = [[item] for item in plan.items]
        jobs = [(f"{prefix}{i}{DEFAULT_SUFFIX}", bucket) for i, bucket in enumerate(buckets)]
        results: list[WriteResult] = []
        files: dict[str, Any] = {}
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count) as pool:
                futs = [pool.submit(self._write_file, staging, n, it, planner) for n, it in jobs]
                outs = [f.result() for f in futs]
        else:
            outs = [self._write_file(staging, n, it, planner) for n, it in jobs]
        for (name, _), (file_results, file_info) in zip(jobs, outs, strict=True):
            results.extend(file_results)
            files[name] = file_info
        summary: dict[str, Any] = {"files": files}
        if self.is_coordinator:
            summary["layouts"] = _layouts_of(planner)
        results.append(
            WriteResult(
                index=MetadataIndex(fqn=f"{_RESULT_KEY}:{self.rank}"),
                size_in_bytes=0,
                storage_data=summary,
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self,
        staging: Path,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
    ) -> tuple[list[WriteResult], dict[str, Any]]:
        results: list[WriteResult] = []
        sums: list[list[int]] = []
        ordered = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
        ordered += [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
        with (staging / name).open("wb") as raw:
            stream = _ChecksumStream(cast(BinaryIO, raw))
            for item in ordered:
                data = planner.resolve_data(item)
                pad = -raw.tell() % _ALIGN
                if pad:  # aligned items let the reader view tensor bytes in place
                    raw.write(b"\0" * pad)
                offset = stream.tell()
                stream.crc = 0
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(cast(io.BytesIO, data).getbuffer())
                else:
                    tensor = cast(torch.Tensor, data).detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()
                    if can_encode(tensor):
                        encode_tensor(tensor, stream.write)
                    else:
                        torch.save(tensor, cast(BinaryIO, stream))
                length = stream.tell() - offset
                sums.append([offset, length, stream.crc])
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
            raw.flush()
            size = raw.tell()
            if self.sync_files:
                os.fsync(raw.fileno())
        return results, {"size": size, "items": sums}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: write ``.metadata`` and the sidecar, then commit by renaming.

        Args:
            metadata: the global metadata built by the planner.
            results: every rank's write results.

        Raises:
            FileExistsError: the target appeared meanwhile and may not be replaced.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.finish`.
        """
        storage_md: dict[MetadataIndex, Any] = {}
        files: dict[str, Any] = {}
        layouts: dict[str, Any] = {}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_RESULT_KEY):
                    files.update(wr.storage_data["files"])
                    layouts.update(wr.storage_data.get("layouts", {}))
                else:
                    storage_md[wr.index] = wr.storage_data
        metadata.version = _DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        staging = staging_dir(self.path)
        try:
            blob = pickle.dumps(metadata)
            write_synced(staging / _METADATA_FILE, blob, self.sync_files)
            files[_METADATA_FILE] = {"size": len(blob), "crc32": crc32(blob)}
            sidecar = {
                "format": _SIDECAR_FORMAT,
                "version": 1,
                "algorithm": "crc32",
                "save_id": self.save_id,
                "created_ns": time.time_ns(),
                "files": files,
                "layouts": layouts,
            }
            sidecar[_SELF_CRC] = crc32(_sidecar_text(sidecar))
            write_synced(staging / CHECKSUM_FILE, _sidecar_text(sidecar), self.sync_files)
            if self.sync_files:
                fsync_dir(staging)
            (staging / INCOMPLETE_MARKER).unlink()
            if self.sync_files:
                fsync_dir(staging)
            self._commit(staging)
        finally:
            self.abort()

    def _commit(self, staging: Path) -> None:
        if self.path.exists():
            self._check_target()
        publish(staging, self.path, self.sync_files)

    def storage_meta(self) -> StorageMeta | None:
        """Return the storage metadata recorded in ``.metadata``.

        Returns:
            The final checkpoint path and this save's id.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageWriter.storage_meta`.
        """
        return StorageMeta(
            checkpoint_id=self.path, save_id=self.save_id, modules=[CHECKSUMS_MARKER]
        )

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The checkpoint directory this writer commits to.

        See Also:
            :pt:`torch.distributed.checkpoint.FileSystemWriter.checkpoint_id`.
        """
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path this writer can write.

        Args:
            checkpoint_id: a candidate checkpoint directory.

        Returns:
            ``True`` for a writable local path.

        See Also:
            :pt:`torch.distributed.checkpoint.FileSystemWriter.validate_checkpoint_id`.
        """
        return FileSystem.validate_checkpoint_id(checkpoint_id)


def _crc_mismatch(file: Path, offset: int, length: int, what: str) -> CheckpointCorruptionError:
    return CheckpointCorruptionError(
        f"checksum mismatch in checkpoint file {file} (bytes {offset}..{offset + length}, "
        f"{what}): the file changed after the save committed (disk corruption or an edited "
        "or truncated copy)"
    )


class FileSystemReader(StorageReader):
    """Safe DCP storage reader: verifies checksums and never runs code from the checkpoint.

    Drop-in for ``torch.distributed.checkpoint.FileSystemReader``; reads checkpoints written
    by hp-dcp and by PyTorch. ``.metadata`` and the tensor pickles are read with hp-dcp's
    allow-list unpickler, byte items and other tensors with ``torch.load(weights_only=True)``
    (never the full unpickler, also not through the default load planner). Every file name is
    confined to the checkpoint directory and must be a regular file; every shape, offset and
    length is checked against the file sizes before anything is read, and all items are read
    and verified before the first one is copied into the state dict, so a bad checkpoint leaves
    it unchanged.

    A checkpoint written by hp-dcp carries checksums and says so in its metadata: every item
    read is verified against its CRC-32 (a mismatch raises :class:`CheckpointCorruptionError`
    naming the file), and a missing checksum file is an error. A checkpoint without checksums
    (written by PyTorch) loads with one :class:`UnverifiedCheckpointWarning`.

    Args:
        path: the checkpoint directory.
        _extension_registry: stream transforms are not supported; must be ``None``.
        verify_checksums: keyword-only. Verify CRC-32s (default). ``False`` skips them
            knowingly (paths, sizes and pickles are still checked).

    Raises:
        ValueError: an extension registry was given.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: PyTorch's file-system reader.
        :pt:`torch.load` (``weights_only=True``): PyTorch's allow-list loading.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        verify_checksums: bool = True,
    ) -> None:
        if _extension_registry is not None:
            raise ValueError(
                "hp_dcp.FileSystemReader does not support stream transform extensions; use "
                "torch.distributed.checkpoint.FileSystemReader for such checkpoints"
            )
        super().__init__()
        self.fs = FileSystem()
        self.path = Path(path)
        self.verify_checksums = verify_checksums
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = str(uuid.uuid4())
        self._checksums: dict[str, Any] | None = None
        self.first_error: BaseException | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Point the reader at a new checkpoint.

        Args:
            checkpoint_id: the new checkpoint directory; ``None`` keeps the current one.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.reset`: the interface method.
        """
        self.storage_data = {}
        self._checksums = None
        self.first_error = None
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self) -> Metadata:
        """Read, verify and check ``.metadata`` with the allow-list unpickler.

        Returns:
            The checkpoint's metadata.

        Raises:
            IncompleteCheckpointError: the directory is not a committed checkpoint.
            CheckpointCorruptionError: ``.metadata`` fails its checksum or its structure and
                size checks, or it records checksums whose file is missing.
            UnsafeCheckpointError: ``.metadata`` needs an opcode or global off the allow-list,
                or names a file outside the checkpoint.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.read_metadata`.
        """
        try:
            metadata = self._read_metadata()
        except BaseException as exc:
            self.first_error = exc
            raise
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def _read_metadata(self) -> Metadata:
        path = check_checkpoint_dir(self.path)
        md_path = path / _METADATA_FILE
        sums = read_checksums(path)
        blob = read_member(path, _METADATA_FILE, str(md_path), _MAX_METADATA_BYTES)
        if sums is not None:
            expected = sums["files"].get(_METADATA_FILE)
            if expected is None or expected.get("crc32") != crc32(blob):
                raise _crc_mismatch(md_path, 0, len(blob), "the DCP metadata")
        metadata = validate_metadata(load_metadata(blob, str(md_path)), str(md_path))
        _check_extents(path, metadata)
        meta = metadata.storage_meta
        if meta is not None and not isinstance(meta, StorageMeta):
            raise CheckpointCorruptionError(f"{md_path} has storage_meta {meta!r:.80}")
        if meta is None:
            meta = metadata.storage_meta = StorageMeta()
        marked = isinstance(meta.modules, list) and CHECKSUMS_MARKER in meta.modules
        if sums is None and marked:
            raise CheckpointCorruptionError(
                f"{path} was saved by hp-dcp with checksums, but its checksum file "
                f"{CHECKSUM_FILE} is missing: the checkpoint cannot be verified and is refused"
            )
        if sums is None:
            warnings.warn(
                f"{path} has no checksums (written by PyTorch or another tool): it is loaded "
                "unverified, so on-disk corruption would go unnoticed",
                UnverifiedCheckpointWarning,
                stacklevel=4,
            )
        self._checksums = sums if self.verify_checksums else None
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the storage index of ``metadata``.

        Args:
            metadata: the checkpoint's metadata.
            is_coordinator: unused.
            *args: unused.
            **kwargs: unused.

        Raises:
            CheckpointCorruptionError: the metadata has no storage index.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.set_up_storage_reader`.
        """
        if metadata.storage_data is None:
            raise CheckpointCorruptionError(f"{self.path}/.metadata has no storage index")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return the local plan unchanged.

        Args:
            plan: the planner's local plan.

        Returns:
            ``plan``.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.prepare_local_plan`.
        """
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return the global plan unchanged.

        Args:
            plans: every rank's local plan.

        Returns:
            ``plans``.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.prepare_global_plan`.
        """
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and verify every item of ``plan``, then copy them into the planner's tensors.

        Args:
            plan: this rank's read items.
            planner: receives byte items and resolves the destination tensors.

        Returns:
            A completed future.

        Raises:
            CheckpointCorruptionError: an item or file fails its checksum or size check, or a
                stored chunk does not match its destination.
            UnsafeCheckpointError: an item needs an object off the allow-list, or a file is
                outside the checkpoint or not a regular file.

        See Also:
            :pt:`torch.distributed.checkpoint.StorageReader.read_data`.
        """
        try:
            with _ReadSession(self.path, self._checksums) as session:
                for req in plan.items:
                    session.add(req, self.storage_data.get(req.storage_index))
                session.stage(planner)
                session.commit(planner)
        except BaseException as exc:
            self.first_error = exc
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The checkpoint directory this reader reads.

        See Also:
            :pt:`torch.distributed.checkpoint.FileSystemReader.checkpoint_id`.
        """
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path.

        Args:
            checkpoint_id: a candidate checkpoint directory.

        Returns:
            ``True`` for a local path.

        See Also:
            :pt:`torch.distributed.checkpoint.FileSystemReader.validate_checkpoint_id`.
        """
        return FileSystem.validate_checkpoint_id(checkpoint_id)


def _check_extents(root: Path, metadata: Metadata) -> None:
    """Every stored item must lie inside its (confined, regular) file: checked before planning,
    so nothing is allocated from sizes the files cannot back."""
    ends: dict[str, tuple[int, str]] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    for rel, (end, fqn) in sorted(ends.items()):
        fd = open_member(root, rel, f"{root}/.metadata")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if end > size:
            raise CheckpointCorruptionError(
                f"checkpoint file {root / rel} has {size} bytes, its items end at byte {end} "
                f"(item {fqn!r}): the file was truncated or the metadata lies about sizes",
                file=rel,
                item=fqn,
            )


def _deliver_bytes(planner: LoadPlanner, req: ReadItem, value: Any, data: bytes) -> None:
    """Hand a safely loaded byte item to the planner without a second, unsafe unpickling.

    torch's ``DefaultLoadPlanner.load_bytes`` re-reads the bytes with ``weights_only=False``;
    for it (and subclasses that keep its ``load_bytes``) the value is stored directly, the same
    way. A planner with its own ``load_bytes`` gets the bytes, already checked by the safe
    unpickler.
    """
    if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
        planner.load_bytes(req, io.BytesIO(data))
        return
    default = cast(DefaultLoadPlanner, planner)
    fqn = req.dest_index.fqn
    if not default.flatten_state_dict:
        default.state_dict[fqn] = value
        return
    node: Any = default.original_state_dict
    path: tuple[Any, ...] = tuple(default.mappings[fqn])
    for key, nxt in itertools.pairwise(path):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, dict):
            node = node.setdefault(key, fresh)
            continue
        while len(node) <= key:
            node.append(None)
        if node[key] is None:
            node[key] = fresh
        node = node[key]
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


class _ReadSession:
    """One ``read_data`` call: every file opened and checked, every item verified and decoded
    (staged), and only then copied into the destination (committed)."""

    def __init__(self, root: Path, sums: dict[str, Any] | None) -> None:
        self._root = root
        self._files = sums["files"] if sums is not None else None
        self._per_file: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        self._bytes: list[tuple[ReadItem, Any, bytes]] = []

    def __enter__(self) -> _ReadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tensors.clear()
        for view in reversed(self._views):
            view.release()
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # a tensor still views it: GC closes it
                mm.close()

    def add(self, req: ReadItem, info: Any) -> None:
        if info is None:
            raise CheckpointCorruptionError(
                f"{self._root}/.metadata has no stored item for {req.storage_index.fqn!r}"
            )
        if getattr(info, "transform_descriptors", None):
            raise ValueError(
                f"checkpoint item {req.storage_index.fqn!r} was written with stream "
                f"transforms {info.transform_descriptors!r}, which hp-dcp does not read; "
                "use torch.distributed.checkpoint.FileSystemReader"
            )
        groups = self._per_file.setdefault(info.relative_path, {})
        groups.setdefault((int(info.offset), int(info.length)), []).append(req)

    def stage(self, planner: LoadPlanner) -> None:
        for rel in sorted(self._per_file):
            self._stage_file(rel, self._per_file[rel], planner)

    def commit(self, planner: LoadPlanner) -> None:
        for req, value, data in self._bytes:
            _deliver_bytes(planner, req, value, data)
        for req, src, target in self._tensors:
            target.copy_(src)
            planner.commit_tensor(req, target)

    def _stage_file(
        self, rel: str, groups: dict[tuple[int, int], list[ReadItem]], planner: LoadPlanner
    ) -> None:
        path = self._root / rel
        expected: dict[int, tuple[int, int]] | None = None
        entry = None
        fd = open_member(self._root, rel, f"{self._root}/.metadata")
        try:
            if self._files is not None:
                entry = self._files.get(rel)
                if entry is None:
                    raise CheckpointCorruptionError(
                        f"checkpoint file {path} is not listed in {CHECKSUM_FILE}"
                    )
                expected = {o: (n, c) for o, n, c in entry.get("items", [])}
            size = os.fstat(fd).st_size
            if entry is not None and size != entry["size"]:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path} has {size} bytes, the save wrote "
                    f"{entry['size']}: the file was truncated or changed"
                )
            end = max(o + n for o, n in groups)
            if end > size:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path} has {size} bytes, its items end at byte {end}: "
                    "the file was truncated or the metadata lies about sizes"
                )
            if size == 0:
                return
            # A private (copy-on-write) mapping: items are viewed in place, never modified.
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._maps.append(mm)
        view = memoryview(mm)
        self._views.append(view)
        for (offset, length), group in sorted(groups.items()):
            blob = view[offset : offset + length]
            self._views.append(blob)
            self._stage_item(path, blob, offset, group, planner, expected)

    def _stage_item(
        self,
        path: Path,
        blob: memoryview,
        offset: int,
        group: list[ReadItem],
        planner: LoadPlanner,
        expected: dict[int, tuple[int, int]] | None,
    ) -> None:
        length = len(blob)
        key = group[0].storage_index.fqn
        if expected is not None:
            rec = expected.get(offset)
            if rec is None or rec[0] != length:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path}: no checksum recorded for bytes "
                    f"{offset}..{offset + length} (item {key!r})"
                )
            if crc32(blob) != rec[1]:
                raise _crc_mismatch(path, offset, length, f"item {key!r}")
        if group[0].type == LoadItemType.BYTE_IO:
            data = bytes(blob)
            value = load_byte_item(data, key, str(path))
            self._bytes.extend((req, value, data) for req in group)
            return
        tensor = decode_tensor(blob)
        if tensor is None:
            tensor = torch_load_tensor(blob, path, key)
        for req in group:
            src = tensor
            for dim, (start, size) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                if dim >= src.dim() or start + size > src.size(dim):
                    raise CheckpointCorruptionError(
                        f"item {key!r} in {path}: the stored chunk has shape "
                        f"{tuple(tensor.size())}, the metadata reads {tuple(req.lengths)} at "
                        f"{tuple(req.storage_offsets)} from it"
                    )
                src = src.narrow(dim, start, size)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise CheckpointCorruptionError(
                    f"item {key!r} in {path}: stored chunk gives shape "
                    f"{tuple(src.size())}, destination expects {tuple(target.size())}"
                )
            self._tensors.append((req, src, target))


def torch_load_tensor(blob: memoryview, path: Path, key: str) -> torch.Tensor:
    """Load a tensor item hp-dcp cannot view in place, with ``torch.load(weights_only=True)``."""
    try:
        loaded = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise weights_only_error(
            exc, f"tensor item {key!r} in {path}", "is not a plain torch.save'd tensor"
        ) from exc
    except (RuntimeError, EOFError, ValueError, KeyError, OSError) as exc:
        raise CheckpointCorruptionError(
            f"tensor item {key!r} in {path} is not a readable torch.save archive "
            f"({type(exc).__name__}: {exc!s:.120})"
        ) from exc
    if not isinstance(loaded, torch.Tensor):
        raise CheckpointCorruptionError(
            f"item {key!r} in {path} holds a {type(loaded).__name__}, expected a tensor"
        )
    return loaded


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
                raise _crc_mismatch(file, 0, size, "whole file")
            for offset, length, crc in entry.get("items", []):
                if crc32(view[offset : offset + length]) != crc:
                    raise _crc_mismatch(file, offset, length, "stored item")
        finally:
            view.release()
