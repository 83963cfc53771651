"""The safe DCP storage reader: checksums verified, allow-list unpickling, confined paths.

Every item of a ``read_data`` call is read, verified and decoded (staged) before the first one
is copied into the state dict (committed), so a bad checkpoint leaves the state dict unchanged.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import mmap
import os
import pickle
import uuid
import warnings
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from hp_dcp._checkpoint_dir import (
    _MAX_METADATA_BYTES,
    _METADATA_FILE,
    CHECKSUM_FILE,
    CHECKSUMS_MARKER,
    check_checkpoint_dir,
    crc_mismatch,
    read_checksums,
)
from hp_dcp._checksum import crc32
from hp_dcp._extensions import ReadTransforms, expanded_limit
from hp_dcp._files import open_member, read_member
from hp_dcp._safe_pickle import load_byte_item, load_metadata, weights_only_error
from hp_dcp._tensor_blob import decode_tensor
from hp_dcp._validate import validate_metadata
from hp_dcp.errors import CheckpointCorruptionError, UnverifiedCheckpointWarning

__all__ = ["FileSystemReader", "torch_load_tensor"]


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
        _extension_registry: PyTorch's ``ExtensionRegistry`` (experimental there too) for items
            written through stream transforms; ``None`` knows PyTorch's built-in ones
            (``ZStandard``, which needs ``zstandard``). Register your own extension classes in
            a registry and pass it. Transformed items are verified on their stored bytes, may
            expand only to the size the metadata gives them, and are unpickled under the same
            allow-lists as any other item.
        verify_checksums: keyword-only. Verify CRC-32s (default). ``False`` skips them
            knowingly (paths, sizes and pickles are still checked).

    Raises:
        TypeError: ``_extension_registry`` is not an extension registry.

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
        self._transforms = ReadTransforms(_extension_registry)
        super().__init__()
        self.fs = FileSystem()
        self.path = Path(path)
        self.verify_checksums = verify_checksums
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._state_dict_metadata: dict[str, Any] = {}
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
                raise crc_mismatch(md_path, 0, len(blob), "the DCP metadata")
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
        self._state_dict_metadata = metadata.state_dict_metadata

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
            with _ReadSession(
                self.path, self._checksums, self._transforms, self._state_dict_metadata
            ) as session:
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

    def __init__(
        self,
        root: Path,
        sums: dict[str, Any] | None,
        transforms: ReadTransforms,
        state_dict_metadata: dict[str, Any],
    ) -> None:
        self._root = root
        self._transforms = transforms
        self._sd_md = state_dict_metadata
        self._descriptors: dict[tuple[str, int, int], list[str]] = {}
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
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            key = (info.relative_path, int(info.offset), int(info.length))
            self._descriptors[key] = list(descriptors)
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
            descriptors = self._descriptors.get((rel, offset, length))
            self._stage_item(path, blob, offset, group, planner, expected, descriptors)

    def _stage_item(
        self,
        path: Path,
        blob: memoryview,
        offset: int,
        group: list[ReadItem],
        planner: LoadPlanner,
        expected: dict[int, tuple[int, int]] | None,
        descriptors: list[str] | None = None,
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
                raise crc_mismatch(path, offset, length, f"item {key!r}")
        is_bytes = group[0].type == LoadItemType.BYTE_IO
        if descriptors:  # verified as stored; now expanded, within what the metadata allows
            where = f"item {key!r} in {path}"
            limit = expanded_limit(self._sd_md, group[0].storage_index, is_bytes, where)
            blob = memoryview(
                self._transforms.expand(blob, descriptors, limit, where, reserve=not is_bytes)
            )
        if is_bytes:
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
