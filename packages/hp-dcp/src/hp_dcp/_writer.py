"""The crash-safe, checksummed DCP storage writer.

Ranks write their items into ``.<name>.hp-dcp-partial`` next to the target, computing a CRC-32
of every stored item as it is written; the coordinator writes ``.metadata`` and the checksum
sidecar and publishes the directory with one rename (``hp_dcp._commit``), under the save lock,
or, into a directory holding other files, moves the files in with ``.metadata`` last
(``hp_dcp._in_place``). Stream extensions (``hp_dcp._extensions``) transform each item on its
way to the file; the checksum is of the stored bytes.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from hp_dcp._checkpoint_dir import (
    _DCP_VERSION,
    _METADATA_FILE,
    _SELF_CRC,
    _SIDECAR_FORMAT,
    CHECKSUM_FILE,
    CHECKSUMS_MARKER,
    INCOMPLETE_MARKER,
    sidecar_text,
    staging_dir,
)
from hp_dcp._checksum import crc32
from hp_dcp._commit import SaveLock, recover_leftovers
from hp_dcp._extensions import WriteTransforms
from hp_dcp._files import fsync_dir, write_synced
from hp_dcp._in_place import foreign_entries, publish_checkpoint
from hp_dcp._integrity import saved_at
from hp_dcp._tensor_blob import can_encode, encode_tensor
from hp_dcp._torch_compat import StorageInfo as _StorageInfo
from hp_dcp._torch_compat import StoragePrefix as _StoragePrefix

__all__ = ["FileSystemWriter"]

_RESULT_KEY = "\x00hp_dcp_file_checksums"
# Items start at multiples of this, so the (64-byte aligned) tensor records inside each
# torch.save archive are aligned in the file, and in a memory map of it.
_ALIGN = 64
_DEFAULT_COPY_AHEAD = 10_000_000
_log = logging.getLogger("hp_dcp.storage")


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

    An existing checkpoint at ``path`` is replaced as a whole directory (``overwrite=True``).
    A directory that also holds other files (``model.pt`` next to a ``torch_save_to_dcp``
    output, logs, notes) gets the checkpoint written alongside them, as PyTorch writes it: the
    data files first, under names no entry there has, ``.metadata`` last, and the previous
    checkpoint in it stays loadable until that last rename; files that are not a checkpoint's
    are never touched or removed. All ranks must see the same file system (as for loading any
    multi-rank DCP checkpoint).

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
        _extensions: PyTorch's stream transforms (experimental there too): a sequence of
            ``StreamTransformExtension`` instances, e.g. ``[ZStandard()]`` from
            ``torch.distributed.checkpoint._extension`` (``zstandard`` must be installed), or
            your own. Every stored item goes through them; the descriptors are recorded per item
            as PyTorch records them, so either library reads the result. Checksums cover the
            stored (transformed) bytes.
        serialization_format: only ``SerializationFormat.TORCH_SAVE`` (the format PyTorch's
            reader loads); use ``HuggingFaceStorageWriter`` for safetensors.

    Raises:
        ValueError: an unsupported ``serialization_format`` or ``thread_count``, or an
            extension whose descriptor is not a short string, was given.
        TypeError: ``_extensions`` is not a sequence of stream transform extensions.

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
        self._transforms = WriteTransforms(_extensions)
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
            FileExistsError: ``path`` holds a checkpoint and ``overwrite=False``, or ``path`` is
                not a directory.
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
            recover_leftovers(
                self.path, staging, saved_at, self.sync_files, publish_fn=publish_checkpoint
            )
            self._check_target()
            tag = self._file_tag()
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
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{tag}"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def _check_target(self) -> None:
        p = self.path
        if not p.exists() and not p.is_symlink():
            return
        if not p.is_dir():
            raise FileExistsError(f"{p} exists and is not a directory; refusing to replace it")
        has_checkpoint = (p / _METADATA_FILE).exists() or (p / CHECKSUM_FILE).exists()
        if has_checkpoint and not self.overwrite:
            raise FileExistsError(f"a checkpoint already exists at {p} and overwrite=False")

    def _file_tag(self) -> str:
        """A per-save tag in the data file names when the target keeps other ``.distcp`` files
        (a save committed in place next to them must not reuse their names)."""
        p = self.path
        if not p.is_dir() or not foreign_entries(p):
            return ""  # the whole directory is replaced
        if any(name.endswith(DEFAULT_SUFFIX) for name in os.listdir(p)):
            return f"{self.save_id[:8]}_"
        return ""

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
        transformed = bool(self._transforms.extensions)
        with (staging / name).open("wb") as raw:
            stream = _ChecksumStream(cast(BinaryIO, raw))
            for item in ordered:
                data = planner.resolve_data(item)
                pad = -raw.tell() % _ALIGN
                if pad:  # aligned items let the reader view tensor bytes in place
                    raw.write(b"\0" * pad)
                offset = stream.tell()
                stream.crc = 0
                # Through the stream transforms, if any: the checksum sees the stored bytes.
                out: Any = self._transforms.wrap(cast(IO[bytes], stream)) if transformed else stream
                if item.type == WriteItemType.BYTE_IO:
                    out.write(cast(io.BytesIO, data).getbuffer())
                else:
                    tensor = cast(torch.Tensor, data).detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()
                    if can_encode(tensor):
                        encode_tensor(tensor, out.write)
                    else:
                        torch.save(tensor, cast(BinaryIO, out))
                if out is not stream:
                    out.close()  # flushes the transforms into the file
                length = stream.tell() - offset
                sums.append([offset, length, stream.crc])
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(
                            name,
                            offset,
                            length,
                            transform_descriptors=self._transforms.descriptors,
                        ),
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
            sidecar[_SELF_CRC] = crc32(sidecar_text(sidecar))
            write_synced(staging / CHECKSUM_FILE, sidecar_text(sidecar), self.sync_files)
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
        publish_checkpoint(staging, self.path, self.sync_files)

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
