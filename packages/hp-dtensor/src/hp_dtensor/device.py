"""The device layer: the only module of hyper-parallel that names device types and dispatch keys.

Every other module asks this one which device the process runs on, which collective backend
belongs to it, how to make streams and events, and how much memory was used. Three devices are
known: the CPU (gloo), NVIDIA GPUs (``cuda``/nccl) and Ascend NPUs (``npu``/hccl, through the
optional ``torch_npu`` plug-in, imported lazily and only when it is installed).

Behaviour on the CPU: streams and events are *hints* (PyTorch treats them as best-effort there),
so their methods keep PyTorch's CPU fallback (they do nothing) and log once at debug level; all
other functions work everywhere.

See Also:
    :pt:`torch.accelerator`: PyTorch's device-generic accelerator API.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import logging
import os
import resource
import sys
import weakref
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_GLOO",
    "BACKEND_HCCL",
    "BACKEND_NCCL",
    "DEVICE_TYPE_CPU",
    "DEVICE_TYPE_CUDA",
    "DEVICE_TYPE_META",
    "DEVICE_TYPE_NPU",
    "DISPATCH_KEY_AUTOGRAD_CPU",
    "DISPATCH_KEY_AUTOGRAD_CUDA",
    "DISPATCH_KEY_AUTOGRAD_NPU",
    "DISPATCH_KEY_CPU",
    "DISPATCH_KEY_CUDA",
    "DISPATCH_KEY_NPU",
    "Event",
    "RecordingEvent",
    "RecordingStream",
    "Stream",
    "StreamLog",
    "current_stream",
    "destroy_process_group",
    "device_count",
    "dispatch_key_for",
    "empty_cache",
    "get_default_backend",
    "get_device",
    "get_device_type",
    "init_process_group",
    "is_accelerator",
    "is_npu_available",
    "memory_stats",
    "peak_memory_bytes",
    "pin_memory_available",
    "reset_peak_memory_stats",
    "set_device",
    "stream",
    "synchronize",
]

_log = logging.getLogger(__name__)

DEVICE_TYPE_CPU = "cpu"
"""Device type string of the host CPU."""
DEVICE_TYPE_CUDA = "cuda"
"""Device type string of NVIDIA GPUs."""
DEVICE_TYPE_NPU = "npu"
"""Device type string of Ascend NPUs (registered by ``torch_npu``)."""
DEVICE_TYPE_META = "meta"
"""Device type string of the meta device (shapes without storage)."""

BACKEND_GLOO = "gloo"
"""Collective backend for CPU tensors."""
BACKEND_NCCL = "nccl"
"""Collective backend for NVIDIA GPUs."""
BACKEND_HCCL = "hccl"
"""Collective backend for Ascend NPUs."""

DISPATCH_KEY_CPU = "CPU"
"""Dispatcher key of CPU kernels (for ``torch.library.Library.impl``)."""
DISPATCH_KEY_CUDA = "CUDA"
"""Dispatcher key of CUDA kernels."""
DISPATCH_KEY_NPU = "PrivateUse1"
"""Dispatcher key of NPU kernels (``torch_npu`` registers the NPU as ``PrivateUse1``)."""
DISPATCH_KEY_AUTOGRAD_CPU = "AutogradCPU"
"""Autograd dispatcher key of the CPU."""
DISPATCH_KEY_AUTOGRAD_CUDA = "AutogradCUDA"
"""Autograd dispatcher key of CUDA."""
DISPATCH_KEY_AUTOGRAD_NPU = "AutogradPrivateUse1"
"""Autograd dispatcher key of the NPU."""

_BACKEND_BY_DEVICE: dict[str, str] = {
    DEVICE_TYPE_CPU: BACKEND_GLOO,
    DEVICE_TYPE_CUDA: BACKEND_NCCL,
    DEVICE_TYPE_NPU: BACKEND_HCCL,
}
_DISPATCH_KEY_BY_DEVICE: dict[str, str] = {
    DEVICE_TYPE_CPU: DISPATCH_KEY_CPU,
    DEVICE_TYPE_CUDA: DISPATCH_KEY_CUDA,
    DEVICE_TYPE_NPU: DISPATCH_KEY_NPU,
}
_NPU_MODULE_NAME = "torch_npu"


# Log-once flags (which CPU fallbacks were already reported at debug level).
_LOGGED: set[str] = set()


def _logged_once(key: str) -> bool:
    """Return True the first time ``key`` is seen in this process (a log-once flag set)."""
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    return True


def _debug_once(key: str, message: str) -> None:
    if _logged_once(key):
        _log.debug(message)


def _import_npu() -> ModuleType | None:
    """Import ``torch_npu`` if it is installed; return the module or None."""
    if _NPU_MODULE_NAME in sys.modules:
        return sys.modules[_NPU_MODULE_NAME]
    if importlib.util.find_spec(_NPU_MODULE_NAME) is None:
        return None
    return importlib.import_module(_NPU_MODULE_NAME)


def is_npu_available() -> bool:
    """Say whether an Ascend NPU can be used (``torch_npu`` installed and a device present).

    ``torch_npu`` is imported here, lazily, the first time this is asked and only when it is
    installed; without it the answer is False and nothing is imported.

    Returns:
        True when ``torch_npu`` imports and reports at least one NPU.

    See Also:
        :pt:`torch.accelerator.is_available`: PyTorch's generic accelerator check.
    """
    module = _import_npu()
    if module is None:
        return False
    npu = getattr(torch, DEVICE_TYPE_NPU, None)
    return bool(npu is not None and npu.is_available())


def get_device_type() -> str:
    """Return the device type this process computes on: ``"cuda"``, ``"npu"`` or ``"cpu"``.

    The answer comes from ``torch.accelerator`` (after ``torch_npu`` is imported when it is
    installed, so that the NPU is registered); without an accelerator it is ``"cpu"``.

    Returns:
        The device type string.

    See Also:
        :pt:`torch.accelerator.current_accelerator`: PyTorch's accelerator query.
    """
    is_npu_available()  # registers the NPU with torch.accelerator when torch_npu is installed
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator.type
    return DEVICE_TYPE_CPU


def is_accelerator(device_type: str | torch.device | None = None) -> bool:
    """Say whether a device type is an accelerator (anything other than CPU and meta).

    Args:
        device_type: a device type or device; None means :func:`get_device_type`.

    Returns:
        True for accelerator devices.

    See Also:
        :pt:`torch.accelerator.is_available`: PyTorch's generic accelerator check.
    """
    kind = _device_type_of(device_type)
    return kind not in (DEVICE_TYPE_CPU, DEVICE_TYPE_META)


def _device_type_of(device: str | torch.device | None) -> str:
    if device is None:
        return get_device_type()
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        # parse by hand: torch.device("npu") fails unless torch_npu is imported
        kind = device.split(":", 1)[0].strip()
        if not kind:
            raise ValueError(f"empty device type in {device!r}")
        return kind
    raise TypeError(f"expected a device type string or torch.device, got {type(device).__name__}")


def device_count(device_type: str | torch.device | None = None) -> int:
    """Return the number of devices of a type visible to this process (1 for the CPU).

    Args:
        device_type: the device type; None means :func:`get_device_type`.

    Returns:
        The device count.

    See Also:
        :pt:`torch.accelerator.device_count`: PyTorch's accelerator count.
    """
    kind = _device_type_of(device_type)
    if kind in (DEVICE_TYPE_CPU, DEVICE_TYPE_META):
        return 1
    module = getattr(torch, kind, None)
    if module is None:
        return 0
    return int(module.device_count())


def get_device(index: int | None = None) -> torch.device:
    """Return the device this process should put its tensors on.

    On the CPU this is ``torch.device("cpu")``. On an accelerator it is the current device
    index (set by :func:`set_device` or :func:`init_process_group`) unless ``index`` is given.

    Args:
        index: an explicit accelerator index.

    Returns:
        The device.

    See Also:
        :pt:`torch.accelerator.current_device_index`: PyTorch's current accelerator index.
    """
    kind = get_device_type()
    if kind == DEVICE_TYPE_CPU:
        return torch.device(DEVICE_TYPE_CPU)
    if index is None:
        index = torch.accelerator.current_device_index()
    return torch.device(kind, index)


def set_device(index: int) -> None:
    """Make an accelerator index current for this process.

    Args:
        index: the accelerator index.

    Raises:
        ValueError: on the CPU only index 0 exists; another index is an error.

    See Also:
        :pt:`torch.accelerator.set_device_index`: PyTorch's generic setter.
    """
    if get_device_type() == DEVICE_TYPE_CPU:
        if index != 0:
            raise ValueError(f"the CPU has a single device index 0, got index {index}")
        return
    torch.accelerator.set_device_index(index)


def pin_memory_available() -> bool:
    """Say whether pinned (page-locked) host memory can be allocated (needs an accelerator).

    Returns:
        True when an accelerator is present.

    See Also:
        :pt:`torch.Tensor.pin_memory`: pinning needs an accelerator runtime.
    """
    return is_accelerator()


def get_default_backend(device_type: str | torch.device | None = None) -> str:
    """Return the collective backend for a device type (gloo, nccl or hccl).

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``; None means :func:`get_device_type`.

    Returns:
        The backend name.

    Raises:
        ValueError: for a device type with no known backend.

    See Also:
        :pt:`torch.distributed.Backend.default_device_backend_map`: PyTorch's device-to-backend map.
    """
    kind = _device_type_of(device_type)
    backend = _BACKEND_BY_DEVICE.get(kind)
    if backend is None:
        known = ", ".join(sorted(_BACKEND_BY_DEVICE))
        raise ValueError(f"no collective backend is known for device type {kind!r}; known: {known}")
    return backend


def dispatch_key_for(device_type: str | torch.device | None = None) -> str:
    """Return the dispatcher key for kernels of a device type (``"CPU"``, ``"CUDA"``, ...).

    Args:
        device_type: the device type; None means :func:`get_device_type`.

    Returns:
        The dispatch key name.

    Raises:
        ValueError: for an unknown device type.

    See Also:
        :pt:`torch.library.Library.impl`: registers a kernel under a dispatch key.
    """
    kind = _device_type_of(device_type)
    key = _DISPATCH_KEY_BY_DEVICE.get(kind)
    if key is None:
        known = ", ".join(sorted(_DISPATCH_KEY_BY_DEVICE))
        raise ValueError(f"no dispatch key is known for device type {kind!r}; known: {known}")
    return key


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
    *,
    device_type: str | None = None,
) -> None:
    """Initialize the default process group with the backend of the detected device.

    Same signature as torch's; ``backend=None`` picks gloo, nccl or hccl for ``device_type``
    (default: the detected device). On an accelerator the process's device index is set from
    ``LOCAL_RANK`` (or ``device_id``) before the group is created.

    Args:
        backend: the backend; None chooses it from the device type.
        init_method: as in torch.
        timeout: as in torch.
        world_size: as in torch.
        rank: as in torch.
        store: as in torch.
        group_name: as in torch.
        pg_options: as in torch.
        device_id: as in torch.
        device_type: the device the group serves (keyword-only extension).

    Raises:
        RuntimeError: when the default process group already exists.

    See Also:
        :pt:`torch.distributed.init_process_group`: PyTorch's initializer.
    """
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized")
    kind = _device_type_of(device_type)
    if backend is None:
        backend = get_default_backend(kind)
    if is_accelerator(kind):
        if device_id is None:
            device_id = int(os.environ.get("LOCAL_RANK", "0"))
        index = device_id if isinstance(device_id, int) else (device_id.index or 0)
        torch.accelerator.set_device_index(index)
        device_id = torch.device(kind, index)
    elif isinstance(device_id, int):
        device_id = None  # a CPU has no index: let torch bind nothing
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=timeout,
        world_size=world_size,
        rank=rank,
        store=store,
        group_name=group_name,
        pg_options=pg_options,
        device_id=device_id,
    )


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Destroy a process group (the default one and all others when ``group`` is None).

    Args:
        group: the group to destroy.

    Raises:
        RuntimeError: when no default process group exists.

    See Also:
        :pt:`torch.distributed.destroy_process_group`: PyTorch's destructor.
    """
    if not dist.is_initialized():
        raise RuntimeError("no default process group is initialized; nothing to destroy")
    dist.destroy_process_group(group)


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for all kernels queued on a device (returns at once on the CPU, which is synchronous).

    Args:
        device: the device; None means the current device.

    See Also:
        :pt:`torch.accelerator.synchronize`: PyTorch's generic synchronize.
    """
    kind = _device_type_of(device)
    if not is_accelerator(kind):
        return
    if isinstance(device, torch.device) and device.index is not None:
        torch.accelerator.synchronize(device)
    else:
        torch.accelerator.synchronize()


class Event:
    """A device event; on the CPU recording and waiting are no-ops (PyTorch's CPU behaviour).

    Args:
        device_type: the device type; None means :func:`get_device_type`.
        enable_timing: record timestamps (accelerators only).

    See Also:
        :pt:`torch.Event`: PyTorch's device-generic event.
    """

    def __init__(self, device_type: str | None = None, *, enable_timing: bool = False) -> None:
        self.device_type = _device_type_of(device_type)
        self._event: torch.Event | None = None
        if is_accelerator(self.device_type):
            self._event = torch.Event(self.device_type, enable_timing=enable_timing)
        else:
            _debug_once("event", "device events are no-ops on the CPU (PyTorch's CPU fallback)")

    @property
    def native(self) -> torch.Event | None:
        """The wrapped ``torch.Event``, or None on the CPU."""
        return self._event

    @classmethod
    def from_native(cls, event: torch.Event) -> Event:
        """Wrap an existing ``torch.Event`` (e.g. one a user recorded after the optimizer).

        Args:
            event: the event.

        Returns:
            The wrapper.
        """
        wrapper = cls(DEVICE_TYPE_CPU)
        wrapper.device_type = event.device.type
        wrapper._event = event
        return wrapper

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on a stream (the current stream by default).

        Args:
            stream: the stream.

        See Also:
            :pt:`torch.Event.record`: the wrapped call.
        """
        if self._event is not None:
            native = stream.native if stream is not None else None
            self._event.record(native)

    def wait(self, stream: Stream | None = None) -> None:
        """Make a stream wait for this event.

        Args:
            stream: the stream; the current one by default.

        See Also:
            :pt:`torch.Event.wait`: the wrapped call.
        """
        if self._event is not None:
            native = stream.native if stream is not None else None
            self._event.wait(native)

    def synchronize(self) -> None:
        """Block the host until the event completes.

        See Also:
            :pt:`torch.Event.synchronize`: the wrapped call.
        """
        if self._event is not None:
            self._event.synchronize()

    def elapsed_time(self, end: Event) -> float:
        """Return the milliseconds between this event and ``end`` (both recorded with timing).

        Args:
            end: the later event.

        Returns:
            The elapsed time in milliseconds.

        Raises:
            RuntimeError: on the CPU: device timing needs an accelerator (use
                ``time.perf_counter`` there).

        See Also:
            :pt:`torch.Event.elapsed_time`: the wrapped call.
        """
        if self._event is None or end.native is None:
            raise RuntimeError(
                "event timing needs an accelerator; on the CPU use time.perf_counter()"
            )
        return float(self._event.elapsed_time(end.native))

    def query(self) -> bool:
        """Return True when all work recorded before the event has completed.

        Returns:
            Whether the event completed (always True on the CPU).

        See Also:
            :pt:`torch.Event.query`: the wrapped call.
        """
        return True if self._event is None else bool(self._event.query())


class Stream:
    """A device stream; on the CPU all work is ordered already, so its methods are no-ops.

    Args:
        device_type: the device type; None means :func:`get_device_type`.
        priority: the stream priority (accelerators only).

    See Also:
        :pt:`torch.Stream`: PyTorch's device-generic stream.
    """

    def __init__(
        self,
        device_type: str | None = None,
        *,
        priority: int = 0,
        _native: torch.Stream | None = None,
    ) -> None:
        self.device_type = _device_type_of(device_type)
        self._stream: torch.Stream | None = _native
        if self._stream is None and is_accelerator(self.device_type):
            self._stream = torch.Stream(self.device_type, priority=priority)
        if self._stream is None:
            _debug_once("stream", "device streams are no-ops on the CPU (PyTorch's CPU fallback)")

    @property
    def native(self) -> torch.Stream | None:
        """The wrapped ``torch.Stream``, or None on the CPU."""
        return self._stream

    def wait_stream(self, other: Stream) -> None:
        """Make this stream wait for all work queued so far on ``other``.

        Args:
            other: the stream to wait for.

        See Also:
            :pt:`torch.Stream.wait_stream`: the wrapped call.
        """
        if self._stream is not None and other.native is not None:
            self._stream.wait_stream(other.native)

    def wait_event(self, event: Event) -> None:
        """Make this stream wait for an event.

        Args:
            event: the event.

        See Also:
            :pt:`torch.Stream.wait_event`: the wrapped call.
        """
        if self._stream is not None and event.native is not None:
            self._stream.wait_event(event.native)

    def record_event(self, event: Event | None = None) -> Event:
        """Record an event on this stream and return it.

        Args:
            event: the event to record; a new one by default.

        Returns:
            The recorded event.

        See Also:
            :pt:`torch.Stream.record_event`: the wrapped call.
        """
        event = event if event is not None else Event(self.device_type)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Block the host until the stream's work completes.

        See Also:
            :pt:`torch.Stream.synchronize`: the wrapped call.
        """
        if self._stream is not None:
            self._stream.synchronize()

    def record_tensor(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is used on this stream.

        Its memory is then not reused before the work queued here so far completes (a no-op
        on the CPU and for tensors of another device).

        Args:
            tensor: a tensor allocated on another stream.

        See Also:
            :pt:`torch.Tensor.record_stream`: the wrapped call.
        """
        if self._stream is not None and tensor.device.type == self.device_type:
            tensor.record_stream(self._stream)

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Start copying a device tensor to host memory on this stream, without a host wait.

        The host buffer is pinned where the device has pinned memory, so the copy is
        asynchronous: its data is valid once an event recorded after it on this stream has
        completed (``Event.synchronize``). A tensor already in host memory is returned as is.

        Args:
            tensor: the tensor to copy.

        Returns:
            The host tensor (``tensor`` itself when it is in host memory already).

        See Also:
            :pt:`torch.Tensor.to` with ``non_blocking=True`` into pinned memory.
        """
        if tensor.device.type == DEVICE_TYPE_CPU:
            return tensor
        host = torch.empty_like(tensor, device=DEVICE_TYPE_CPU, pin_memory=pin_memory_available())
        with stream(self):
            host.copy_(tensor, non_blocking=True)
        return host

    @classmethod
    def from_native(cls, native: torch.Stream) -> Stream:
        """Wrap an existing ``torch.Stream`` (e.g. one a user passes to a hook setter).

        Args:
            native: the stream.

        Returns:
            The wrapper.
        """
        return cls(native.device.type, _native=native)

    def _entered(self) -> None:
        """Called when :func:`stream` makes this stream current (a hook for test doubles)."""

    def _left(self) -> None:
        """Called when :func:`stream` restores the previous stream (a hook for test doubles)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        if self._stream is None or other._stream is None:
            return self._stream is None and other._stream is None
        return bool(self._stream == other._stream)

    def __hash__(self) -> int:
        return hash((self.device_type, self._stream))


class StreamLog:
    """What :class:`RecordingStream` and :class:`RecordingEvent` did, in order (a test double).

    Each entry is a tuple: ``("enter", stream)``, ``("leave", stream)``,
    ``("wait_stream", waiter, waited)``, ``("record", event, stream)``,
    ``("wait_event", stream, event)``, ``("record_tensor", stream)``,
    ``("copy_to_host", stream)``, ``("synchronize", what)``, or ``("alloc", label, n)`` /
    ``("free", label, n)`` for buffers given to :meth:`track`; streams and events appear by
    name. ``ran_on`` maps labels given to :meth:`mark` to the stream current at that point.

    See Also:
        :pt:`torch.Stream` / :pt:`torch.Event`: the calls being recorded.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[str, ...]] = []
        self._current: list[str] = ["compute"]
        self.ran_on: dict[str, list[str]] = {}
        self._tracked = 0

    @property
    def current(self) -> str:
        """The name of the stream current now (``"compute"`` outside any recorded stream)."""
        return self._current[-1]

    def mark(self, label: str) -> None:
        """Note that the work called ``label`` runs now, on the current stream.

        Args:
            label: a name for the work (e.g. ``"all_gather"``).
        """
        self.ran_on.setdefault(label, []).append(self.current)

    def track(self, tensor: torch.Tensor, label: str) -> None:
        """Log ``("alloc", label, n)`` now and ``("free", label, n)`` when ``tensor`` dies.

        ``n`` numbers the buffers tracked so far (from 0), so a test can follow each one's
        lifetime against the stream entries between its allocation and its free.

        Args:
            tensor: the buffer.
            label: its kind (e.g. ``"all_gather_output"``).
        """
        n = self._tracked
        self._tracked += 1
        self.entries.append(("alloc", label, str(n)))
        weakref.finalize(tensor, self.entries.append, ("free", label, str(n)))

    def count(self, kind: str) -> int:
        """How many entries of a kind were recorded (e.g. ``"synchronize"``).

        Args:
            kind: the first element of the entries to count.

        Returns:
            The count.
        """
        return sum(1 for entry in self.entries if entry[0] == kind)


class RecordingStream(Stream):
    """A CPU stream double that records how it is used into a :class:`StreamLog`.

    Args:
        name: the stream's name in the log.
        log: the shared log.

    See Also:
        :pt:`torch.Stream`: the stream it stands in for.
    """

    def __init__(self, name: str, log: StreamLog) -> None:
        super().__init__(DEVICE_TYPE_CPU)
        self.name = name
        self.log = log

    def wait_stream(self, other: Stream) -> None:
        """Record that this stream waits for ``other``.

        Args:
            other: the stream waited for.
        """
        self.log.entries.append(("wait_stream", self.name, getattr(other, "name", "compute")))

    def wait_event(self, event: Event) -> None:
        """Record that this stream waits for ``event``.

        Args:
            event: the event waited for.
        """
        self.log.entries.append(("wait_event", self.name, getattr(event, "name", "external")))

    def record_event(self, event: Event | None = None) -> Event:
        """Record a (new) event on this stream.

        Args:
            event: the event to record; a new :class:`RecordingEvent` by default.

        Returns:
            The event.
        """
        if event is None:
            event = RecordingEvent(f"{self.name}_event", self.log)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Record a host synchronization on this stream."""
        self.log.entries.append(("synchronize", self.name))

    def record_tensor(self, tensor: torch.Tensor) -> None:
        """Record that a tensor's lifetime now extends to this stream.

        Args:
            tensor: the tensor.
        """
        self.log.entries.append(("record_tensor", self.name))

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Record a device-to-host copy on this stream and return a host copy.

        The double treats every tensor as device memory, so the code path an accelerator
        takes (an asynchronous copy the host must wait for with an event) runs on the CPU.

        Args:
            tensor: the tensor to copy.

        Returns:
            A new host tensor with its values.
        """
        self.log.entries.append(("copy_to_host", self.name))
        return tensor.clone()

    def _entered(self) -> None:
        self.log.entries.append(("enter", self.name))
        self.log._current.append(self.name)

    def _left(self) -> None:
        self.log._current.pop()
        self.log.entries.append(("leave", self.name))

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


class RecordingEvent(Event):
    """A CPU event double that records into a :class:`StreamLog`.

    Args:
        name: the event's name in the log.
        log: the shared log.

    See Also:
        :pt:`torch.Event`: the event it stands in for.
    """

    def __init__(self, name: str, log: StreamLog) -> None:
        super().__init__(DEVICE_TYPE_CPU)
        self.name = name
        self.log = log

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (the current one by default).

        Args:
            stream: the stream.
        """
        where = getattr(stream, "name", None) or self.log.current
        self.log.entries.append(("record", self.name, where))

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (the current one by default) wait for this event.

        Args:
            stream: the stream.
        """
        where = getattr(stream, "name", None) or self.log.current
        self.log.entries.append(("wait_event", where, self.name))

    def synchronize(self) -> None:
        """Record a host synchronization on this event."""
        self.log.entries.append(("synchronize", self.name))


def current_stream(device_type: str | None = None) -> Stream:
    """Return the current stream of a device (a no-op stream on the CPU).

    Args:
        device_type: the device type; None means :func:`get_device_type`.

    Returns:
        The current stream.

    See Also:
        :pt:`torch.accelerator.current_stream`: PyTorch's generic query.
    """
    kind = _device_type_of(device_type)
    if not is_accelerator(kind):
        return Stream(kind)
    return Stream(kind, _native=torch.accelerator.current_stream())


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Make ``s`` the current stream inside the block (nothing changes on the CPU).

    Args:
        s: the stream; None leaves the current stream as is.

    Yields:
        Nothing.

    See Also:
        :pt:`torch.cuda.stream`-style contexts; :pt:`torch.accelerator.set_stream`.
    """
    if s is not None:
        s._entered()
    if s is None or s.native is None:
        try:
            yield
        finally:
            if s is not None:
                s._left()
        return
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(s.native)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)
        s._left()


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_stats(device: str | torch.device | None = None) -> dict[str, int]:
    """Return memory statistics in bytes: ``allocated``, ``peak_allocated``, ``reserved``.

    On an accelerator these are the caching allocator's counters. On the CPU they describe the
    process: ``allocated`` is the resident set size, ``peak_allocated`` the peak resident set
    size since start or the last :func:`reset_peak_memory_stats`, ``reserved`` equals
    ``allocated``.

    Args:
        device: the device; None means the current one.

    Returns:
        The statistics.

    See Also:
        :pt:`torch.accelerator.memory_stats`: PyTorch's allocator statistics.
    """
    kind = _device_type_of(device)
    if is_accelerator(kind):
        return {
            "allocated": int(torch.accelerator.memory_allocated()),
            "peak_allocated": int(torch.accelerator.max_memory_allocated()),
            "reserved": int(torch.accelerator.memory_reserved()),
        }
    rss = _read_status_kib("VmRSS")
    hwm = _read_status_kib("VmHWM")
    if hwm is None:  # no procfs: ru_maxrss is KiB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return {"allocated": peak, "peak_allocated": peak, "reserved": peak}
    current = (rss or 0) * 1024
    return {"allocated": current, "peak_allocated": hwm * 1024, "reserved": current}


def peak_memory_bytes(device: str | torch.device | None = None) -> int:
    """Return the peak memory in bytes: peak allocated on accelerators, peak RSS on the CPU.

    Args:
        device: the device; None means the current one.

    Returns:
        The peak in bytes.

    See Also:
        :pt:`torch.accelerator.max_memory_allocated`: PyTorch's accelerator peak.
    """
    return memory_stats(device)["peak_allocated"]


def empty_cache() -> None:
    """Release the accelerator allocator's cached blocks (nothing is cached on the CPU).

    On the CPU this is PyTorch's fallback (nothing to release), logged once at debug level.

    See Also:
        :pt:`torch.accelerator.empty_cache`: PyTorch's generic call.
    """
    if is_accelerator():
        torch.accelerator.empty_cache()
        return
    _debug_once("empty_cache", "empty_cache is a no-op on the CPU (no caching allocator)")


def reset_peak_memory_stats(device: str | torch.device | None = None) -> None:
    """Reset the peak counter read by :func:`peak_memory_bytes`.

    On the CPU the kernel's peak-RSS mark is reset through ``/proc/self/clear_refs``.

    Args:
        device: the device; None means the current one.

    Raises:
        RuntimeError: on a CPU system without a writable ``/proc/self/clear_refs`` (Linux only).

    See Also:
        :pt:`torch.accelerator.reset_peak_memory_stats`: PyTorch's accelerator reset.
    """
    kind = _device_type_of(device)
    if is_accelerator(kind):
        torch.accelerator.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError as error:
        raise RuntimeError(
            "resetting the CPU peak-RSS counter needs Linux's writable /proc/self/clear_refs"
        ) from error
