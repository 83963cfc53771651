"""Exceptions raised by hp-dcp when a checkpoint cannot be trusted or read."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptionError",
    "ConcurrentSaveError",
    "IncompleteCheckpointError",
    "UnsafeCheckpointError",
    "UnverifiedCheckpointWarning",
]


class CheckpointCorruptionError(RuntimeError):
    """A checkpoint file does not match the checksum recorded when it was written.

    The message names the file (and the byte range inside it) whose contents changed after the
    save committed: a flipped bit on disk, a truncated copy, or a file edited by hand.

    Attributes:
        file: the damaged file, relative to the checkpoint, when known.
        item: the damaged item (its state-dict key), when known.

    See Also:
        :pt:`torch.distributed.checkpoint.CheckpointException`: PyTorch's DCP error wrapper.
    """

    def __init__(self, message: str, *, file: str | None = None, item: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.item = item


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory was left behind by a save that did not finish on every rank.

    hp-dcp writes into a temporary directory and renames it into place only after all ranks
    have written their files, so a directory carrying the incomplete marker (or a missing
    checkpoint next to a leftover temporary directory) means the save was interrupted.

    See Also:
        :pt:`torch.distributed.checkpoint.CheckpointException`: PyTorch's DCP error wrapper.
    """


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds something hp-dcp refuses to read: code to run, or a path outside it.

    Raised when ``.metadata`` or an item would need a pickle opcode or global off hp-dcp's
    allow-list (the message names the opcode or the global), or when a file name recorded in
    the checkpoint leaves its directory or is not a regular file. hp-dcp never falls back to
    the full unpickler; allow specific classes with ``torch.serialization.safe_globals``.

    See Also:
        :pt:`torch.serialization.safe_globals`: PyTorch's allow-list for ``weights_only`` loads.
    """


class ConcurrentSaveError(RuntimeError):
    """Another save into the same checkpoint path is in progress.

    Saves into one path take a lock file (``.<name>.hp-dcp-lock`` next to it) recording the
    owner's host and pid; the message names them. A lock left by a dead process is taken over.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemWriter`: PyTorch does not lock.
    """


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without checksums (written by PyTorch or another tool) was read unverified.

    Issued once per load. A checkpoint written by hp-dcp records in its metadata that it has
    checksums, so deleting its checksum file makes loading fail instead of warn.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader`: reads without verifying.
    """
