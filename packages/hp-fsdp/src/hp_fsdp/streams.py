"""The communication streams of a root and the events that order them.

Four streams besides the compute stream, as in PyTorch's FSDP2::

    compute  ──wait──▶ copy-in ──event──▶ all-gather ──event──▶ compute (copy-out)
    compute  ──wait──▶ reduce-scatter ──event──▶ all-reduce (HSDP) ──event──▶ compute

- *copy-in*: packs (and casts) the local shards into the all-gather input, off the compute
  stream, after the compute stream (or the post-optimizer event) says the shards are final;
- *all-gather*: issues the all-gather once the copy-in event completed;
- *reduce-scatter*: packs the gradients and reduce-scatters them once the compute stream
  produced them; the post-reduce division/cast runs there too;
- *all-reduce*: HSDP's replicate-axis all-reduce, after the reduce-scatter event.

On the CPU every stream is the device layer's no-op stream, so the same code runs with
program order; tests substitute :meth:`CommStreams.recording` to observe the order.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPCommContext`: PyTorch's
    streams.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor.device import (
    Event,
    RecordingEvent,
    RecordingStream,
    Stream,
    StreamLog,
    current_stream,
    is_accelerator,
)
from hp_dtensor.device import stream as device_stream
from hp_fsdp._profiling import NO_OP

__all__ = ["CommStreams"]

_NO_STREAM: AbstractContextManager[object] = NO_OP


@dataclass(frozen=True)
class CommStreams:
    """The streams of one root's communication and a factory for the events between them.

    Attributes:
        compute: the stream forward and backward run on.
        copy_in: packs all-gather inputs.
        all_gather: issues all-gathers.
        reduce_scatter: packs, reduce-scatters and post-processes gradients.
        all_reduce: issues HSDP all-reduces.
        new_event: makes an event (its argument names it for logs).
        log: the recording log, when the streams are the recording double.
        active: whether streams and events do anything (device streams or the recording
            double); on the CPU the runtime skips them altogether (no per-call cost).
    """

    compute: Stream
    copy_in: Stream
    all_gather: Stream
    reduce_scatter: Stream
    all_reduce: Stream
    new_event: Callable[[str], Event]
    log: StreamLog | None = None
    active: bool = True

    @classmethod
    def for_device(cls, device: torch.device) -> CommStreams:
        """Streams for a device: new high-priority streams on accelerators, no-ops on the CPU.

        Args:
            device: the compute device.

        Returns:
            The streams.
        """
        kind = device.type
        if not is_accelerator(kind):
            noop = Stream(kind)
            return cls(noop, noop, noop, noop, noop, lambda name: Event(kind), active=False)
        return cls(
            current_stream(kind),
            Stream(kind, priority=-1),
            Stream(kind, priority=-1),
            Stream(kind, priority=-1),
            Stream(kind, priority=-1),
            lambda name: Event(kind),
        )

    @classmethod
    def recording(cls, log: StreamLog) -> CommStreams:
        """The recording double: CPU streams that log every wait, record and entry into ``log``.

        Args:
            log: the log to fill.

        Returns:
            The streams.
        """
        return cls(
            RecordingStream("compute", log),
            RecordingStream("copy_in", log),
            RecordingStream("all_gather", log),
            RecordingStream("reduce_scatter", log),
            RecordingStream("all_reduce", log),
            lambda name: RecordingEvent(name, log),
            log,
        )

    def on(self, stream: Stream) -> AbstractContextManager[object]:
        """Make ``stream`` current inside the block (nothing at all when not :attr:`active`).

        Args:
            stream: one of these streams.

        Returns:
            The context manager.
        """
        return device_stream(stream) if self.active else _NO_STREAM

    def current(self) -> Stream:
        """The stream current now (the compute stream of the recording double).

        Returns:
            The stream.
        """
        if self.log is not None or self.compute.native is None:
            return self.compute
        return current_stream(self.compute.device_type)

    @property
    def device_ordered(self) -> bool:
        """Whether the streams are real device streams (events order the work, not the host)."""
        return self.compute.native is not None

    def order_on_stream(self, work: dist.Work | None) -> dist.Work | None:
        """Make the current stream wait for an issued collective (device streams only).

        With device streams, ``Work.wait`` blocks only the current stream, not the host; the
        event recorded next then marks the collective's completion. On the CPU the work
        handle is returned untouched and waited for later (gloo runs it in the background).

        Args:
            work: the collective's work handle.

        Returns:
            None when the stream now orders the collective, else ``work``.
        """
        if work is None or not self.device_ordered:
            return work
        work.wait()
        return None

    def track(self, tensor: torch.Tensor, label: str) -> None:
        """Note for the recording double when a buffer is allocated and when it is freed.

        Args:
            tensor: the buffer (its Python object's lifetime is logged).
            label: the buffer's kind (e.g. ``"all_gather_output"``).
        """
        if self.log is not None:
            self.log.track(tensor, label)

    def mark(self, label: str) -> None:
        """Note for the recording double which stream the work ``label`` runs on.

        Args:
            label: the work's name.
        """
        if self.log is not None:
            self.log.mark(label)
