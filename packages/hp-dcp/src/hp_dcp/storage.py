"""Crash-safe, checksummed file-system storage in PyTorch's DCP on-disk format.

A checkpoint written here is a plain DCP directory (``.metadata`` plus ``__<rank>_<n>.distcp``
files holding ``torch.save`` blobs) that ``torch.distributed.checkpoint.FileSystemReader`` reads
as is. Two files are added next to them and ignored by PyTorch:

* ``.hp_dcp_checksums.json``: a CRC-32 per stored item (computed on the bytes as they are
  written, hardware-accelerated with ``isal``), the size of every file, and the DTensor layout
  (mesh shape, placements) of every tensor.
* while the save runs, ``.hp_dcp_incomplete``: the marker of an unfinished save.

Ranks write into ``.<name>.hp-dcp-partial`` next to the target; the coordinator renames it to
the target only after every rank reported its files written and synced, so an interrupted save
never replaces (or looks like) a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import mmap
import os
import pickle
import shutil
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    SerializationFormat,
    _StorageInfo,
    _StoragePrefix,
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
from hp_dcp._safe_pickle import check_byte_item, load_metadata
from hp_dcp._tensor_blob import can_encode, decode_tensor, encode_tensor
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)

__all__ = [
    "CHECKSUM_FILE",
    "INCOMPLETE_MARKER",
    "FileSystemReader",
    "FileSystemWriter",
    "check_checkpoint_dir",
    "read_checksums",
    "staging_dir",
    "verify_checkpoint",
]

CHECKSUM_FILE = ".hp_dcp_checksums.json"
"""Name of the sidecar file holding per-item CRC-32s, file sizes and tensor layouts."""

INCOMPLETE_MARKER = ".hp_dcp_incomplete"
"""Marker file present in a checkpoint directory while its save has not committed."""

_METADATA_FILE = ".metadata"
_DCP_VERSION = "1.0.0"
_SIDECAR_FORMAT = "hp-dcp-checksums"
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
        ``torch.distributed.checkpoint.FileSystemWriter``: PyTorch writes in place instead.
    """
    p = Path(path)
    return p.parent / f".{p.name}.hp-dcp-partial"


def _retired_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.hp-dcp-old"


def _fsync_dir(path: Path) -> None:
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


def _write_synced(path: Path, data: bytes, sync: bool) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


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
        ``torch.distributed.checkpoint.FileSystemReader``: PyTorch's reader, which does not
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
        partial, retired = staging_dir(p), _retired_dir(p)
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
    if not (p / _METADATA_FILE).is_file():
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

    See Also:
        ``torch.distributed.checkpoint.FileSystemReader.read_metadata``: PyTorch's metadata read.
    """
    sidecar = Path(path) / CHECKSUM_FILE
    if not sidecar.is_file():
        return None
    try:
        data = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptionError(
            f"{sidecar} is unreadable or not valid JSON: {exc}"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != _SIDECAR_FORMAT:
        raise CheckpointCorruptionError(f"{sidecar} is not an hp-dcp checksum file")
    return cast(dict[str, Any], data)


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
        ``torch.distributed.checkpoint.FileSystemWriter``: PyTorch's file-system writer.
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

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Point the writer at a new checkpoint and start a new save.

        Args:
            checkpoint_id: the new checkpoint directory; ``None`` keeps the current one.

        See Also:
            ``torch.distributed.checkpoint.StorageWriter.reset``: the interface method.
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
            ``torch.distributed.checkpoint.StorageWriter.set_up_storage_writer``.
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
            ``torch.distributed.checkpoint.StorageWriter.prepare_local_plan``.
        """
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: refuse a forbidden overwrite, create the staging directory.

        Args:
            plans: every rank's local plan.

        Returns:
            The plans, each given the file prefix ``__<rank>_``.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite=False``, or ``path`` is a non-empty
                directory that is not a DCP checkpoint.

        See Also:
            ``torch.distributed.checkpoint.StorageWriter.prepare_global_plan``.
        """
        self._check_target()
        staging = staging_dir(self.path)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        (staging / INCOMPLETE_MARKER).write_text(f"save {self.save_id} in progress\n")
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
            ``torch.distributed.checkpoint.StorageWriter.write_data``.
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
            ``torch.distributed.checkpoint.StorageWriter.finish``.
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
        blob = pickle.dumps(metadata)
        _write_synced(staging / _METADATA_FILE, blob, self.sync_files)
        files[_METADATA_FILE] = {"size": len(blob), "crc32": crc32(blob)}
        sidecar = {
            "format": _SIDECAR_FORMAT,
            "version": 1,
            "algorithm": "crc32",
            "save_id": self.save_id,
            "files": files,
            "layouts": layouts,
        }
        _write_synced(
            staging / CHECKSUM_FILE,
            json.dumps(sidecar, separators=(",", ":")).encode(),
            self.sync_files,
        )
        (staging / INCOMPLETE_MARKER).unlink()
        if self.sync_files:
            _fsync_dir(staging)
        self._commit(staging)

    def _commit(self, staging: Path) -> None:
        target = self.path
        retired = None
        if target.exists():
            self._check_target()
            retired = _retired_dir(target)
            if retired.exists():
                shutil.rmtree(retired)
            target.rename(retired)
        staging.rename(target)
        if self.sync_files:
            _fsync_dir(target.parent)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)

    def storage_meta(self) -> StorageMeta | None:
        """Return the storage metadata recorded in ``.metadata``.

        Returns:
            The final checkpoint path and this save's id.

        See Also:
            ``torch.distributed.checkpoint.StorageWriter.storage_meta``.
        """
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The checkpoint directory this writer commits to.

        See Also:
            ``torch.distributed.checkpoint.FileSystemWriter.checkpoint_id``.
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
            ``torch.distributed.checkpoint.FileSystemWriter.validate_checkpoint_id``.
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
    by hp-dcp and by PyTorch. ``.metadata`` is read with an allow-list unpickler, tensors with
    ``torch.load(weights_only=True)`` and byte items are checked with PyTorch's ``weights_only``
    allow-list before the planner sees them. When the checkpoint carries hp-dcp's checksum
    sidecar, every item read is verified against its CRC-32 and file sizes are checked; a
    mismatch raises :class:`CheckpointCorruptionError` naming the file.
    Checkpoints written by PyTorch have no sidecar and are read unverified.

    Args:
        path: the checkpoint directory.
        _extension_registry: stream transforms are not supported; must be ``None``.
        allow_unsafe_pickle: keyword-only. Read ``.metadata`` and byte items with the full
            unpickler. Only for checkpoints you trust: unpickling can execute arbitrary code.
        verify_checksums: keyword-only. Verify CRC-32s when the sidecar exists (default).

    Raises:
        ValueError: an extension registry was given.

    See Also:
        ``torch.distributed.checkpoint.FileSystemReader``: PyTorch's file-system reader.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        allow_unsafe_pickle: bool = False,
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
        self.allow_unsafe_pickle = allow_unsafe_pickle
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
            ``torch.distributed.checkpoint.StorageReader.reset``: the interface method.
        """
        self.storage_data = {}
        self._checksums = None
        self.first_error = None
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self) -> Metadata:
        """Read and verify ``.metadata`` with the allow-list unpickler.

        Returns:
            The checkpoint's metadata.

        Raises:
            IncompleteCheckpointError: the directory is not a committed checkpoint.
            CheckpointCorruptionError: ``.metadata`` fails its checksum.
            UnsafeCheckpointError: ``.metadata`` references a class off the allow-list.

        See Also:
            ``torch.distributed.checkpoint.StorageReader.read_metadata``.
        """
        try:
            path = check_checkpoint_dir(self.path)
            self._checksums = read_checksums(path) if self.verify_checksums else None
            md_path = path / _METADATA_FILE
            blob = md_path.read_bytes()
            if self._checksums is not None:
                expected = self._checksums["files"].get(_METADATA_FILE)
                if expected is None or expected.get("crc32") != crc32(blob):
                    raise _crc_mismatch(md_path, 0, len(blob), "the DCP metadata")
            metadata = load_metadata(
                blob, str(md_path), allow_unsafe_pickle=self.allow_unsafe_pickle
            )
            if not isinstance(metadata, Metadata):
                raise CheckpointCorruptionError(
                    f"{md_path} holds a {type(metadata).__name__}, expected DCP Metadata"
                )
        except BaseException as exc:
            self.first_error = exc
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
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
            ``torch.distributed.checkpoint.StorageReader.set_up_storage_reader``.
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
            ``torch.distributed.checkpoint.StorageReader.prepare_local_plan``.
        """
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return the global plan unchanged.

        Args:
            plans: every rank's local plan.

        Returns:
            ``plans``.

        See Also:
            ``torch.distributed.checkpoint.StorageReader.prepare_global_plan``.
        """
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and decode the items of ``plan`` into the planner's tensors.

        Args:
            plan: this rank's read items.
            planner: receives byte items and resolves the destination tensors.

        Returns:
            A completed future.

        Raises:
            CheckpointCorruptionError: an item or file fails its checksum or size check.
            UnsafeCheckpointError: a byte item holds an object off the allow-list.

        See Also:
            ``torch.distributed.checkpoint.StorageReader.read_data``.
        """
        try:
            self._read_all(plan, planner)
        except BaseException as exc:
            self.first_error = exc
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise ValueError(
                    f"checkpoint item {req.storage_index.fqn!r} was written with stream "
                    f"transforms {info.transform_descriptors!r}, which hp-dcp does not read; "
                    "use torch.distributed.checkpoint.FileSystemReader"
                )
            per_file.setdefault(info.relative_path, []).append((req, info))
        files = self._checksums["files"] if self._checksums is not None else None
        for rel in sorted(per_file):
            self._read_file(rel, per_file[rel], planner, files)

    def _read_file(
        self,
        rel: str,
        reqs: list[tuple[ReadItem, Any]],
        planner: LoadPlanner,
        files: dict[str, Any] | None,
    ) -> None:
        path = self.path / rel
        expected_items: dict[int, tuple[int, int]] | None = None
        if files is not None:
            entry = files.get(rel)
            if entry is None:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path} is not listed in {CHECKSUM_FILE}"
                )
            expected_items = {int(o): (int(n), int(c)) for o, n, c in entry["items"]}
        groups: dict[tuple[int, int], list[ReadItem]] = {}
        for req, info in reqs:
            groups.setdefault((int(info.offset), int(info.length)), []).append(req)
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if files is not None and size != files[rel]["size"]:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path} has {size} bytes, the save wrote "
                    f"{files[rel]['size']}: the file was truncated or changed"
                )
            if size == 0:
                raise CheckpointCorruptionError(f"checkpoint file {path} is empty")
            # A private (copy-on-write) mapping: items are viewed in place, never modified.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        view = memoryview(mm)
        try:
            for (offset, length), group in sorted(groups.items()):
                if offset + length > size:
                    raise CheckpointCorruptionError(
                        f"checkpoint file {path} ends before byte {offset + length}"
                    )
                blob = view[offset : offset + length]
                try:
                    self._read_item(path, blob, offset, group, planner, expected_items)
                finally:
                    blob.release()
        finally:
            view.release()
            with contextlib.suppress(BufferError):  # a tensor still views it: GC closes it
                mm.close()

    def _read_item(
        self,
        path: Path,
        blob: memoryview,
        offset: int,
        group: list[ReadItem],
        planner: LoadPlanner,
        expected_items: dict[int, tuple[int, int]] | None,
    ) -> None:
        length = len(blob)
        key = group[0].storage_index.fqn
        if expected_items is not None:
            rec = expected_items.get(offset)
            if rec is None or rec[0] != length:
                raise CheckpointCorruptionError(
                    f"checkpoint file {path}: no checksum recorded for bytes "
                    f"{offset}..{offset + length}"
                )
            if crc32(blob) != rec[1]:
                raise _crc_mismatch(path, offset, length, f"item {key!r}")
        if group[0].type == LoadItemType.BYTE_IO:
            data = bytes(blob)
            if not self.allow_unsafe_pickle:
                check_byte_item(data, key, str(path))
            for req in group:
                planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = decode_tensor(blob)
        if tensor is None:
            tensor = self._torch_load(blob, path, key)
        for req in group:
            src = tensor
            for dim, (start, size) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                src = src.narrow(dim, start, size)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise CheckpointCorruptionError(
                    f"item {key!r} in {path}: stored chunk gives shape "
                    f"{tuple(src.size())}, destination expects {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        del tensor, src

    def _torch_load(self, blob: memoryview, path: Path, key: str) -> torch.Tensor:
        try:
            loaded = torch.load(
                io.BytesIO(bytes(blob)),
                map_location="cpu",
                weights_only=not self.allow_unsafe_pickle,
            )
        except pickle.UnpicklingError as exc:
            text = str(exc).strip()
            raise UnsafeCheckpointError(
                f"tensor item {key!r} in {path} is not a plain torch.save'd tensor "
                f"({text.splitlines()[0] if text else type(exc).__name__}); loading it could "
                "execute arbitrary code. Load it knowingly with allow_unsafe_pickle=True."
            ) from exc
        if not isinstance(loaded, torch.Tensor):
            raise CheckpointCorruptionError(
                f"item {key!r} in {path} holds a {type(loaded).__name__}, expected a tensor"
            )
        return loaded

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The checkpoint directory this reader reads.

        See Also:
            ``torch.distributed.checkpoint.FileSystemReader.checkpoint_id``.
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
            ``torch.distributed.checkpoint.FileSystemReader.validate_checkpoint_id``.
        """
        return FileSystem.validate_checkpoint_id(checkpoint_id)


def verify_checkpoint(path: str | os.PathLike[str]) -> list[str]:
    """Verify every byte of a checkpoint against its checksum sidecar, offline.

    Args:
        path: the checkpoint directory.

    Returns:
        The names of the files verified.

    Raises:
        IncompleteCheckpointError: ``path`` is not a committed checkpoint.
        CheckpointCorruptionError: a file fails its size or checksum check.
        FileNotFoundError: the checkpoint has no checksum sidecar (written by PyTorch).

    See Also:
        ``torch.distributed.checkpoint.FileSystemReader``: PyTorch reads without verifying.
    """
    p = check_checkpoint_dir(path)
    sums = read_checksums(p)
    if sums is None:
        raise FileNotFoundError(f"{p} has no {CHECKSUM_FILE}: it was not written by hp-dcp")
    checked: list[str] = []
    for name, entry in sorted(sums["files"].items()):
        file = p / name
        if not file.is_file():
            raise CheckpointCorruptionError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointCorruptionError(
                f"checkpoint file {file} has {size} bytes, the save wrote {entry['size']}"
            )
        if size == 0:
            checked.append(name)
            continue
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                if "crc32" in entry and crc32(view) != entry["crc32"]:
                    raise _crc_mismatch(file, 0, size, "whole file")
                for offset, length, crc in entry.get("items", []):
                    if crc32(view[offset : offset + length]) != crc:
                        raise _crc_mismatch(file, offset, length, "stored item")
            finally:
                view.release()
        checked.append(name)
    return checked
