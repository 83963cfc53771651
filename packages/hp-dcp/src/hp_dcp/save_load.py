"""``save`` / ``async_save`` / ``load``: torch DCP's entry points on hp-dcp's safe storage."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import load as _torch_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as _torch_async_save
from torch.distributed.checkpoint.state_dict_saver import save as _torch_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from hp_dcp.errors import (
    CheckpointCorruptionError,
    ConcurrentSaveError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp.storage import FileSystemReader, FileSystemWriter, check_checkpoint_dir

__all__ = ["async_save", "load", "save"]

_OWN_ERRORS = (
    CheckpointCorruptionError,
    ConcurrentSaveError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    FileExistsError,
    FileNotFoundError,
    ValueError,
)


def _default_writer(
    checkpoint_id: str | os.PathLike[str] | None,
    storage_writer: StorageWriter | None,
    use_collectives: bool,
    fn: str,
) -> StorageWriter:
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError(
                f"hp_dcp.{fn} needs checkpoint_id (a directory path) or storage_writer; got neither"
            )
        storage_writer = FileSystemWriter(checkpoint_id)
    if not use_collectives and isinstance(storage_writer, FileSystemWriter):
        raise ValueError(
            f"hp_dcp.{fn}(use_collectives=False) cannot commit crash-safely: the coordinator must "
            "see every rank's results. Pass storage_writer=torch.distributed.checkpoint."
            "FileSystemWriter(...) to save without coordination."
        )
    return storage_writer


def _unwrap(exc: BaseException, reader: object) -> BaseException | None:
    """Return the hp-dcp error behind a DCP wrapper exception, if there is one."""
    own = getattr(reader, "first_error", None)
    if isinstance(own, _OWN_ERRORS) and own is not exc:
        return own
    if isinstance(exc, CheckpointException):
        for rank, (err, _trace) in sorted(exc.failures.items()):
            if isinstance(err, _OWN_ERRORS):
                return type(err)(f"{err} [reported by rank {rank}]")
    return None


@contextmanager
def _own_errors(reader: object) -> Iterator[None]:
    """Re-raise the hp-dcp error behind a DCP wrapper exception raised in the block."""
    try:
        yield
    except (Exception, CheckpointException) as exc:
        own = _unwrap(exc, reader)
        if own is not None:
            raise own from exc
        raise


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """Save a (sharded) state dict in SPMD style, in torch DCP's on-disk format.

    Every rank calls it with its own state dict; each rank writes only its local shards of
    DTensors, replicated values are written once. With the default storage the save is
    crash-safe: files go to a temporary directory that is renamed to ``checkpoint_id`` only
    after every rank finished (see :class:`hp_dcp.FileSystemWriter`), and a CRC-32 per item
    is recorded for :func:`load` to verify. ``Stateful`` values are saved through their
    ``state_dict()``.

    Args:
        state_dict: the state dict (nested dicts and lists allowed) to save.
        checkpoint_id: the checkpoint directory.
        storage_writer: a DCP storage writer; default :class:`hp_dcp.FileSystemWriter` on
            ``checkpoint_id``.
        planner: a DCP save planner; default ``DefaultSavePlanner``.
        process_group: the group whose ranks take part; default the world.
        no_dist: save from this process alone, without collectives.
        use_collectives: ``False`` is only allowed with a storage writer that supports
            uncoordinated saves (PyTorch's), because the crash-safe commit needs every rank's
            results.

    Returns:
        The checkpoint's global metadata.

    Raises:
        ValueError: neither ``checkpoint_id`` nor ``storage_writer`` was given, or
            ``use_collectives=False`` with hp-dcp's writer.
        FileExistsError: the target exists and may not be replaced.

    See Also:
        :pt:`torch.distributed.checkpoint.save`: PyTorch's DCP save.
    """
    writer = _default_writer(checkpoint_id, storage_writer, use_collectives, "save")
    try:
        with _own_errors(None):
            metadata: Metadata = _torch_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=writer,
                planner=planner,
                process_group=process_group,
                no_dist=no_dist,
                use_collectives=use_collectives,
            )
    finally:
        if isinstance(writer, FileSystemWriter):
            writer.abort()
    return metadata


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future[Any] | AsyncSaveResponse:
    """Stage the state dict to host memory, then save it in the background.

    Same contract as :func:`save` (crash-safe commit, checksums); the call returns once the
    state dict is staged. Use a dedicated (gloo) ``process_group`` when training keeps issuing
    collectives on the default group while the save runs in its thread.

    Args:
        state_dict: the state dict to save.
        checkpoint_id: the checkpoint directory.
        storage_writer: a DCP storage writer; default :class:`hp_dcp.FileSystemWriter`, which
            also stages (copies to host memory).
        planner: a DCP save planner.
        process_group: the group whose ranks take part; it needs a CPU backend.
        async_checkpointer_type: ``THREAD`` (default) or ``PROCESS``.
        async_stager: a custom stager; default the storage writer.
        no_dist: save from this process alone.
        use_collectives: must stay ``True`` with hp-dcp's writer.

    Returns:
        A future completing with the metadata when the save committed (or an
        ``AsyncSaveResponse`` when the stager stages asynchronously).

    Raises:
        ValueError: neither ``checkpoint_id`` nor ``storage_writer`` was given, or
            ``use_collectives=False`` with hp-dcp's writer.

    See Also:
        :pt:`torch.distributed.checkpoint.async_save`: PyTorch's asynchronous DCP save.
    """
    writer = _default_writer(checkpoint_id, storage_writer, use_collectives, "async_save")
    result = _torch_async_save(
        state_dict,
        checkpoint_id=checkpoint_id,
        storage_writer=writer,
        planner=planner,
        process_group=process_group,
        async_checkpointer_type=async_checkpointer_type,
        async_stager=async_stager,
        no_dist=no_dist,
        use_collectives=use_collectives,
    )
    if isinstance(writer, FileSystemWriter):
        done = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        done.add_done_callback(lambda _: writer.abort())
    return result


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """Load a checkpoint in place into ``state_dict``, resharding to its layout.

    Each rank passes a state dict whose values have the layout it wants (DTensors of any mesh
    and placements, plain tensors, or other values); the stored chunks are read, verified and
    copied into them, whatever world size and layout the checkpoint was saved with. Reads
    checkpoints written by hp-dcp and by torch DCP. With the default reader, nothing in the
    checkpoint can run code: a checkpoint that pickled Python objects off the allow-list
    raises :class:`hp_dcp.UnsafeCheckpointError` (allow specific classes with
    ``torch.serialization.safe_globals``), and a failed load leaves ``state_dict`` unchanged
    on this rank. A checkpoint without checksums loads with one
    :class:`hp_dcp.UnverifiedCheckpointWarning`.

    Args:
        state_dict: the state dict to fill in place (``Stateful`` values are loaded through
            ``load_state_dict``).
        checkpoint_id: the checkpoint directory.
        storage_reader: a DCP storage reader; default :class:`hp_dcp.FileSystemReader`.
        planner: a DCP load planner; default ``DefaultLoadPlanner``.
        process_group: the group whose ranks take part.
        no_dist: load in this process alone.

    Raises:
        ValueError: neither ``checkpoint_id`` nor ``storage_reader`` was given, or a tensor's
            shape in ``state_dict`` differs from the checkpoint's (raised by torch's planner).
        IncompleteCheckpointError: the checkpoint is from an interrupted save.
        CheckpointCorruptionError: a file fails its checksum or size checks, or the checksum
            file of a checkpoint saved with checksums is missing; the message names the file.
        UnsafeCheckpointError: the checkpoint holds objects off the allow-list, or names a
            file outside its directory or one that is not a regular file.

    See Also:
        :pt:`torch.distributed.checkpoint.load`: PyTorch's DCP load.
        :pt:`torch.load` (``weights_only=True``): PyTorch's allow-list loading.
    """
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError(
                "hp_dcp.load needs checkpoint_id (a directory path) or storage_reader; got neither"
            )
        storage_reader = FileSystemReader(checkpoint_id)
    if isinstance(storage_reader, FileSystemReader):
        check_checkpoint_dir(checkpoint_id if checkpoint_id is not None else storage_reader.path)
    with _own_errors(storage_reader):
        _torch_load(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_reader=storage_reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
