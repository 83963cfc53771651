"""Activation swap: saved activations moved to host memory in forward, loaded back before backward.

A :class:`~hp_trainer.SwapManager` owns one side stream, one host-buffer pool and the ordered list
of ``SwapGroup`` objects (one per swapped layer call). Packing a saved tensor registers its
storage in the current group; when the layer's forward ends, the group copies each storage once to
a pooled host buffer on the side stream and drops its device reference (the device storage is
freed once autograd held the only other reference). In backward, the first unpack of a group
makes sure its loads are done and launches the loads of the group that runs backward next, so the
copies overlap the current layer's backward.

The host never waits for a copy: every ordering is an event recorded on the copy stream and
waited on by the compute stream (or a stream wait), so the host can run layers ahead of the
device in forward and backward. A group's device storages are dropped once the compute stream
waits for its offload event (later allocations on the compute stream come after the copy); the
compute stream waits for a group's load event before its backward reads the loaded tensors; a
host buffer goes back to the pool with its load event, and the stream that reuses it waits for
that event first.

On a device without separate host memory (CPU), swap is a documented pass-through in memory
terms: the same hooks, pool, copies and ordering run, the bytes just move between two buffers of
the same memory, so nothing is saved; streams and events are the device layer's CPU no-ops.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import SelectiveCheckpointContext

from hp_dtensor import device as hp_device
from hp_trainer._torch_compat import TorchDispatchMode, disable_current_modes

__all__ = ["CheckpointPolicy", "HostBufferPool", "SwapGroup", "SwapManager"]


class CheckpointPolicy(enum.IntEnum):
    """What to do with an op's output in backward: PyTorch's four choices plus ``MUST_SWAP``.

    ``MUST_SWAP`` keeps the output (like ``MUST_SAVE``) but moves it to host memory between
    forward and backward.

    See Also:
        :pt:`torch.utils.checkpoint.CheckpointPolicy`: PyTorch's four values (same numbers).
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4

    def to_torch(self) -> torch.utils.checkpoint.CheckpointPolicy:
        """PyTorch's value for this policy (``MUST_SWAP`` saves, the swap is done by our hooks).

        Returns:
            The ``torch.utils.checkpoint.CheckpointPolicy`` member.
        """
        value = int(self) if self is not CheckpointPolicy.MUST_SWAP else 0
        return torch.utils.checkpoint.CheckpointPolicy(value)


class HostBufferPool:
    """Reusable host byte buffers (pinned where the device layer has pinned memory).

    A released buffer is handed out again for a later request of the same size, so a training
    loop allocates its host memory in the first step only.

    Args:
        pin: Allocate page-locked buffers; ``None`` asks ``hp_dtensor.device``.

    Raises:
        ValueError: If ``pin=True`` on a machine without pinned memory (no accelerator).
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        available = hp_device.pin_memory_available()
        if pin and not available:
            raise ValueError("HostBufferPool(pin=True) needs an accelerator with pinned memory")
        self.pin = available if pin is None else pin
        self._free: dict[int, list[tuple[torch.Tensor, hp_device.Event | None]]] = {}
        self.allocations = 0
        """Number of buffers created (not reused) so far."""

    def acquire(self, nbytes: int, *, stream: hp_device.Stream | None = None) -> torch.Tensor:
        """Return a ``uint8`` host buffer of ``nbytes`` bytes, reusing a released one if any.

        Args:
            nbytes: The size.
            stream: The stream that will write the buffer: it waits for the event the buffer
                was released with (the copy that last read it), without a host wait.

        Returns:
            The buffer.
        """
        free = self._free.get(nbytes)
        if free:
            buffer, event = free.pop()
            if event is not None and stream is not None:
                stream.wait_event(event)
            return buffer
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)

    def release(self, buffer: torch.Tensor, *, event: hp_device.Event | None = None) -> None:
        """Give a buffer back for reuse.

        Args:
            buffer: A buffer from :meth:`~hp_trainer.HostBufferPool.acquire`.
            event: Completes when the last copy reading the buffer is done (None: nothing
                pending).
        """
        self._free.setdefault(buffer.numel(), []).append((buffer, event))

    @property
    def free_bytes(self) -> int:
        """Bytes held by the pool and not handed out."""
        return sum(n * len(bufs) for n, bufs in self._free.items())


class _SwappedStorage:
    """One device storage of a group: device -> host (offload) -> device (load)."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.device_storage: torch.UntypedStorage | None = storage
        self.host: torch.Tensor | None = None
        self.loaded: torch.UntypedStorage | None = None


class _SavedHandle:
    """What autograd keeps instead of a swapped tensor: a storage slot and the view geometry."""

    def __init__(self, group: SwapGroup, slot: _SwappedStorage, tensor: torch.Tensor) -> None:
        self.group = group
        self.slot = slot
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.requires_grad = tensor.requires_grad


class SwapGroup:
    """The swapped activations of one layer call, copied out and back together.

    Args:
        manager: The owning manager.
        index: Position in forward order.
    """

    def __init__(self, manager: SwapManager, index: int) -> None:
        self.manager = manager
        self.index = index
        self._slots: dict[int, _SwappedStorage] = {}
        self.state = "forward"
        """``forward`` -> ``offloading`` -> ``host`` -> ``loading`` -> ``device``."""
        self._offload_event: hp_device.Event | None = None
        self._load_event: hp_device.Event | None = None
        self.packs = 0
        self.unpacks = 0

    def add(self, tensor: torch.Tensor) -> _SavedHandle:
        """Register a saved tensor (its storage is copied once however many views are saved).

        Args:
            tensor: The saved tensor.

        Returns:
            The handle autograd keeps.
        """
        storage = tensor.untyped_storage()
        # keyed by address while the group holds the storage, so the address cannot be reused
        key = storage.data_ptr()
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _SwappedStorage(storage)
        self.packs += 1
        self.manager.log.append(("pack", self.index))
        return _SavedHandle(self, slot, tensor)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages in this group."""
        total = 0
        for slot in self._slots.values():
            if slot.host is not None:
                total += slot.host.numel()
            elif slot.device_storage is not None:
                total += slot.device_storage.nbytes()
        return total

    def launch_offload(self) -> None:
        """Queue the device-to-host copies on the side stream."""
        if self.state != "forward":
            return
        mgr = self.manager
        mgr.log.append(("offload", self.index))
        copy = mgr.copy_stream
        copy.wait_stream(mgr.compute_stream())  # the layer's forward wrote the activations
        with hp_device.stream(copy):
            for slot in self._slots.values():
                src = slot.device_storage
                assert src is not None
                host = mgr.pool.acquire(src.nbytes(), stream=copy)
                host.untyped_storage().copy_(src, non_blocking=mgr.pool.pin)
                slot.host = host
        self._offload_event = copy.record_event(mgr.new_event(f"offload{self.index}"))
        self.state = "offloading"

    def wait_offload(self) -> None:
        """Order the compute stream after the copies, then drop the device storages.

        No host wait: the storages were allocated on the compute stream, which now waits for
        the offload event, so the caching allocator reuses their memory only after the copies
        (freed unless used elsewhere).
        """
        if self.state != "offloading":
            return
        assert self._offload_event is not None
        self._offload_event.wait(self.manager.compute_stream())
        for slot in self._slots.values():
            slot.device_storage = None
        self.state = "host"

    def launch_load(self) -> None:
        """Queue the host-to-device copies on the side stream."""
        if self.state == "offloading":
            self.wait_offload()
        if self.state != "host":
            return
        mgr = self.manager
        mgr.log.append(("load", self.index))
        copy = mgr.copy_stream
        # after the compute work queued so far: the loaded blocks the copy stream allocates
        # may reuse memory that work still reads
        copy.wait_stream(mgr.compute_stream())
        with hp_device.stream(copy):
            for slot in self._slots.values():
                host = slot.host
                assert host is not None
                dev = torch.empty(host.numel(), dtype=torch.uint8, device=mgr.device_type)
                dev.copy_(host, non_blocking=mgr.pool.pin)
                slot.loaded = dev.untyped_storage()
        self._load_event = copy.record_event(mgr.new_event(f"load{self.index}"))
        self.state = "loading"

    def wait_load(self) -> None:
        """Make the compute stream wait for the loads and give the host buffers back.

        No host wait: each buffer returns to the pool with the load event, which the stream
        that writes it next waits for (:meth:`~hp_trainer.HostBufferPool.acquire`).
        """
        if self.state in ("offloading", "host"):
            self.launch_load()
        if self.state != "loading":
            return
        assert self._load_event is not None
        self._load_event.wait(self.manager.compute_stream())
        for slot in self._slots.values():
            assert slot.host is not None
            self.manager.pool.release(slot.host, event=self._load_event)
            slot.host = None
        self.state = "device"

    def restore(self, item: Any, *, requires_grad: bool = False) -> Any:
        """``item`` unchanged, unless it is a handle :meth:`add` returned: then its tensor.

        Args:
            item: Anything a saved-tensor slot holds (a handle, a tensor, ``None``, ...).
            requires_grad: Keyword-only; give the rebuilt tensor back its ``requires_grad``
                flag (a checkpoint's saved inputs).

        Returns:
            The rebuilt tensor (:meth:`unpack`), or ``item``.
        """
        if not isinstance(item, _SavedHandle):
            return item
        out = self.unpack(item)
        return out.requires_grad_() if requires_grad and item.requires_grad else out

    def unpack(self, handle: _SavedHandle) -> torch.Tensor:
        """Rebuild a saved tensor from its loaded storage (waiting for the load if needed).

        Args:
            handle: The handle returned at pack time.

        Returns:
            A tensor with the saved values, dtype and view geometry.
        """
        # the loads are the swap's own copies: a recompute's dispatch modes (selective
        # checkpointing) must neither see nor cache them
        with disable_current_modes():
            mgr = self.manager
            if self.unpacks == 0:
                mgr.log.append(("backward", self.index))
                self.wait_load()
                mgr.prefetch_before(self.index)
            else:
                self.wait_load()
            self.unpacks += 1
            mgr.log.append(("unpack", self.index))
            storage = handle.slot.loaded
            assert storage is not None
            out = torch.empty(0, dtype=handle.dtype, device=mgr.device_type)
            out.set_(storage, handle.offset, handle.size, handle.stride)
        return out


class _SwapMarker(TorchDispatchMode):
    """Records the output storages of ops a policy marks ``MUST_SWAP``."""

    def __init__(
        self, policy_fn: Callable[..., Any], marked: dict[int, torch.UntypedStorage]
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.policy_fn = policy_fn
        self.marked = marked

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ctx = SelectiveCheckpointContext(is_recompute=False)
        policy = self.policy_fn(ctx, func, *args, **kwargs)
        if policy == CheckpointPolicy.MUST_SWAP:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    # by storage: autograd often saves a reshaped alias of the op's output; the
                    # storage is held until the layer's forward ends so its address stays unique
                    storage = t.untyped_storage()
                    self.marked[storage.data_ptr()] = storage
        return out


class SwapManager:
    """Swaps saved activations of layer calls to host memory and prefetches them for backward.

    Use :meth:`~hp_trainer.SwapManager.swap_region` around a layer's forward (``swap`` and
    ``swap_wrapper`` do). The group of the layer that runs backward next is loaded when the
    current group's backward starts.

    Args:
        device_type: Device whose tensors are swapped; ``None`` asks ``hp_dtensor.device``.
        pool: Host buffer pool (a new one by default).
        stream_log: Use the device layer's recording double instead of real streams (tests):
            the compute and copy streams are ``RecordingStream("compute")`` /
            ``RecordingStream("copy")`` and each group's events are named ``offload<i>`` /
            ``load<i>`` in this log. None: the device's current stream and a new side stream.

    See Also:
        HyperParallel's ``SwapManager``; :pt:`torch.autograd.graph.save_on_cpu` (PyTorch's
        synchronous, unpooled, unprefetched counterpart).
    """

    def __init__(
        self,
        device_type: str | None = None,
        *,
        pool: HostBufferPool | None = None,
        stream_log: hp_device.StreamLog | None = None,
    ):
        self.device_type = device_type or hp_device.get_device_type()
        self.pool = pool if pool is not None else HostBufferPool()
        self._stream_log = stream_log
        self._compute: hp_device.Stream | None = None
        self._copy_stream: hp_device.Stream | None = None
        if stream_log is not None:
            self._compute = hp_device.RecordingStream("compute", stream_log)
            self._copy_stream = hp_device.RecordingStream("copy", stream_log)
        self.groups: list[SwapGroup] = []
        self.log: list[tuple[str, int]] = []
        """The ``(event, group index)`` pairs in order; events are ``pack``, ``offload``, ``load``,
        ``backward`` (a group's first unpack) and ``unpack``."""

    @property
    def copy_stream(self) -> hp_device.Stream:
        """The side stream of the copies, created on first use.

        A manager that ends up swapping nothing (``checkpoint`` with a policy that never says
        ``MUST_SWAP``) never creates one.
        """
        if self._copy_stream is None:
            self._copy_stream = hp_device.Stream(self.device_type)
        return self._copy_stream

    def compute_stream(self) -> hp_device.Stream:
        """The stream forward and backward run on (the device's current stream).

        Returns:
            The stream.
        """
        if self._compute is not None:
            return self._compute
        return hp_device.current_stream(self.device_type)

    def new_event(self, name: str) -> hp_device.Event:
        """A new event (named ``name`` in the recording double's log).

        Args:
            name: The event's name, e.g. ``"offload3"``.

        Returns:
            The event.
        """
        if self._stream_log is not None:
            return hp_device.RecordingEvent(name, self._stream_log)
        return hp_device.Event(self.device_type)

    def new_group(self) -> SwapGroup:
        """Start the group of the next layer call (groups of a finished step are dropped).

        Returns:
            The group.
        """
        if self.groups and all(g.state == "device" for g in self.groups):
            self.groups.clear()
        group = SwapGroup(self, len(self.groups))
        self.groups.append(group)
        return group

    def prefetch_before(self, index: int) -> None:
        """Launch the loads of the group whose backward comes after group ``index``'s.

        Args:
            index: The group whose backward is starting.
        """
        for group in reversed(self.groups[:index]):
            if group.packs:
                group.launch_load()
                return

    def swap_region(
        self, fn: Callable[..., Any], *args: Any, policy_fn: Callable[..., Any] | None = None
    ) -> Any:
        """Run ``fn(*args)`` with its saved activations swapped to host memory.

        Args:
            fn: The layer function.
            *args: Its arguments.
            policy_fn: ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``; only outputs of ops
                marked ``MUST_SWAP`` are swapped. ``None`` swaps every saved activation.

        Returns:
            ``fn(*args)``.
        """
        with self.region(policy_fn):
            return fn(*args)

    @contextlib.contextmanager
    def region(self, policy_fn: Callable[..., Any] | None = None) -> Iterator[SwapGroup]:
        """Swap the activations saved inside the block (one layer call, one group).

        Unlike :meth:`swap_region`, the hooks can be entered from module hooks around a
        ``torch.compile``'d forward (the compiled graph's saved tensors go through them).

        Args:
            policy_fn: See :meth:`swap_region` (eager only: it observes ops by dispatch).

        Yields:
            The group of this call.
        """
        group = self.new_group()
        marked: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> Any:
            if not self._eligible(t) or (
                policy_fn is not None and t.untyped_storage().data_ptr() not in marked
            ):
                return t
            return group.add(t)

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _SavedHandle):
                return saved.group.unpack(saved)
            return saved  # type: ignore[no-any-return]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if policy_fn is None:
                yield group
            else:
                with _SwapMarker(policy_fn, marked):
                    yield group
        marked.clear()
        self.finish_forward(group)

    def finish_forward(self, group: SwapGroup) -> None:
        """End a group's forward: finish the previous groups' copies, start this group's.

        A group that registered nothing is done at once (it has nothing to load back).

        Args:
            group: The group whose layer call just ended (from :meth:`new_group`).
        """
        # the previous layer's copies had this whole layer's forward to finish
        for previous in self.groups:
            if previous is not group:
                previous.wait_offload()
        if group.packs == 0:
            group.state = "device"
            return
        group.launch_offload()

    def wait_all_offloads(self) -> None:
        """Finish every pending device-to-host copy (frees the device storages)."""
        for group in self.groups:
            group.wait_offload()

    def can_swap(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is swapped: a plain tensor on this device that is not a parameter.

        Args:
            t: A tensor about to be saved.

        Returns:
            ``True`` if registering it in a group moves it to host memory.
        """
        return self._eligible(t)

    def _eligible(self, t: torch.Tensor) -> bool:
        # parameters (and views of them) stay alive anyway: copying them would only cost
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False
        return t.device.type == self.device_type and type(t) is torch.Tensor
