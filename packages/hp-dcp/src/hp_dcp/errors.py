"""Exceptions raised by hp-dcp when a checkpoint cannot be trusted or read."""

from __future__ import annotations

__all__ = ["CheckpointCorruptionError", "IncompleteCheckpointError", "UnsafeCheckpointError"]


class CheckpointCorruptionError(RuntimeError):
    """A checkpoint file does not match the checksum recorded when it was written.

    The message names the file (and the byte range inside it) whose contents changed after the
    save committed: a flipped bit on disk, a truncated copy, or a file edited by hand.

    See Also:
        ``torch.distributed.checkpoint.CheckpointException``: PyTorch's DCP error wrapper.
    """


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory was left behind by a save that did not finish on every rank.

    hp-dcp writes into a temporary directory and renames it into place only after all ranks
    have written their files, so a directory carrying the incomplete marker (or a missing
    checkpoint next to a leftover temporary directory) means the save was interrupted.

    See Also:
        ``torch.distributed.checkpoint.CheckpointException``: PyTorch's DCP error wrapper.
    """


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint would need to run arbitrary Python code to be loaded.

    hp-dcp reads ``.metadata`` and every byte item with an allow-list unpickler. A checkpoint
    that pickled other Python objects is rejected with this error; load it knowingly with
    ``allow_unsafe_pickle=True`` (only for checkpoints you trust) or allow the specific classes
    with ``torch.serialization.safe_globals``.

    See Also:
        ``torch.serialization.safe_globals``: PyTorch's allow-list for ``weights_only`` loads.
    """
