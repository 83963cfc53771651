"""Symmetric-memory all-gather buffers, pooled: allocated and rendezvoused once, then reused.

``FSDPModule.set_symm_mem_for_comm`` makes a unit all-gather into symmetric memory, which NCCL
turns into its symmetric kernels or copy-engine all-gather. A symmetric buffer is costly to set
up (an allocation from the symmetric heap, then a collective ``rendezvous`` that maps it into
every rank of the group), so buffers are never freed between all-gathers: a
:class:`SymmetricBufferPool` hands one out for an all-gather, takes it back once its data was
copied out into the unsharded parameters, and gives it to the next all-gather of the same dtype
and size, of any unit. Each buffer is rendezvoused once per process group that gathers into it.
The pools live in the root's communication context (shared by every unit of the root), held
weakly: they and their buffers are released when the last all-gather using them is replaced
(another ``set_symm_mem_for_comm`` / ``set_custom_all_gather`` call) or the model is deleted.

Where the buffers come from is a :class:`SymmetricMemory` (PyTorch's NCCL symmetric memory by
default; a test passes a double through ``set_symm_mem_for_comm(memory=...)``).

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.SymmMemAllGather`: PyTorch's
    all-gather, which allocates from the symmetric memory pool and rendezvouses per call.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hp_dtensor.device import BACKEND_NCCL, DEVICE_TYPE_CUDA, Event, current_stream
from hp_kernels import DefaultAllGather

__all__ = [
    "NCCLSymmetricMemory",
    "SymmetricBufferPool",
    "SymmetricBufferPools",
    "SymmetricMemory",
    "SymmetricMemoryAllGather",
]


class SymmetricMemory(Protocol):
    """Where symmetric buffers come from (PyTorch's NCCL symmetric memory, or a test double)."""

    def unavailable(self, device: torch.device, groups: Sequence[dist.ProcessGroup]) -> str | None:
        """Why buffers on ``device`` cannot be shared over ``groups`` (None: they can)."""
        ...

    def prepare(self, group: dist.ProcessGroup) -> None:
        """Get ``group`` ready for its first rendezvous (collective, once per group)."""
        ...

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat symmetric buffer."""
        ...

    def rendezvous(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Map ``buffer`` into every rank of ``group`` (collective)."""
        ...


@dataclass(frozen=True)
class NCCLSymmetricMemory:
    """PyTorch's symmetric memory with the NCCL backend (CUDA, compute capability 9.0+).

    Equal instances share pools, so every unit configured with the default shares buffers.

    Args:
        backend: the symmetric-memory backend name (``"NCCL"``).

    See Also:
        :pt:`torch.distributed._symmetric_memory`: ``empty``, ``rendezvous``, ``set_backend``,
        ``get_backend``.
    """

    backend: str = "NCCL"

    def unavailable(self, device: torch.device, groups: Sequence[dist.ProcessGroup]) -> str | None:
        """Why NCCL symmetric memory cannot be used on ``device`` over ``groups``.

        Args:
            device: the unit's compute device.
            groups: the process groups it all-gathers over.

        Returns:
            The reason, or None when it can be used.
        """
        needs = "needs NCCL symmetric memory on an accelerator of compute capability 9.0 (SM90)"
        if device.type != DEVICE_TYPE_CUDA:
            return f"{needs} or newer; this unit computes on {device.type}"
        for group in groups:
            backend = dist.get_backend(group)
            if backend != BACKEND_NCCL:
                return f"{needs} or newer; its process group uses {backend}"
        major, _ = getattr(torch, DEVICE_TYPE_CUDA).get_device_capability(device)
        if major < 9:
            return f"{needs} or newer; the device has compute capability {major}.x"
        return None

    def prepare(self, group: dist.ProcessGroup) -> None:
        """Create the group's communicator before its first rendezvous.

        Args:
            group: the process group.
        """
        dist.barrier(group=group)  # a lazily created NCCL communicator would miss the rendezvous

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer from the symmetric heap.

        Args:
            numel: its number of elements.
            dtype: its dtype.
            device: its device.

        Returns:
            The buffer.
        """
        from hp_fsdp._torch_compat import symm_mem_empty, symm_mem_get_backend, symm_mem_set_backend

        # The backend is chosen before the first allocation (it cannot change afterwards; a
        # process that already allocated with another backend gets torch's error here).
        if symm_mem_get_backend(device) != self.backend:
            symm_mem_set_backend(self.backend)
        return symm_mem_empty(numel, dtype=dtype, device=device)

    def rendezvous(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Map ``buffer`` into every rank of ``group``.

        Args:
            buffer: a buffer from :meth:`empty`.
            group: the process group.
        """
        from hp_fsdp._torch_compat import symm_mem_rendezvous

        symm_mem_rendezvous(buffer, group)


@dataclass(eq=False)
class _PooledBuffer:
    tensor: torch.Tensor
    #: Names of the process groups this buffer was rendezvoused with.
    groups: set[str] = field(default_factory=set)
    #: Recorded where the buffer was last read (its next user's stream waits for it).
    released: Event | None = None


class SymmetricBufferPool:
    """The symmetric buffers of one device: free lists per (dtype, size), reused forever.

    Args:
        memory: where buffers come from.
        device: their device.

    Attributes:
        acquisitions: buffers handed out so far (one per all-gather).
        allocations: buffers allocated so far (each once).
        rendezvous_count: rendezvous issued so far (each buffer once per group).
    """

    def __init__(self, memory: SymmetricMemory, device: torch.device) -> None:
        self.memory = memory
        self.device = device
        self.acquisitions = 0
        self.allocations = 0
        self.rendezvous_count = 0
        self._free: dict[tuple[torch.dtype, int], list[_PooledBuffer]] = {}
        self._in_use: list[_PooledBuffer] = []
        self._prepared: set[str] = set()

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer of the pool, free or in use."""
        free = [b.tensor for bufs in self._free.values() for b in bufs]
        return free + [b.tensor for b in self._in_use]

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype``: a free one, else a new one.

        The current stream waits until the buffer's previous reader is done with it.

        Args:
            numel: the number of elements.
            dtype: the dtype.

        Returns:
            The flat buffer (give it back with :meth:`release`).
        """
        free = self._free.get((dtype, numel))
        if free:
            buffer = free.pop()
            if buffer.released is not None:
                buffer.released.wait()
                buffer.released = None
        else:
            buffer = _PooledBuffer(self.memory.empty(numel, dtype, self.device))
            self.allocations += 1
        self._in_use.append(buffer)
        self.acquisitions += 1
        return buffer.tensor

    def rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Rendezvous an acquired buffer with ``group``, unless that was done already.

        Args:
            tensor: a buffer from :meth:`acquire`, not yet released.
            group: the group about to gather into it.
        """
        buffer = self._owner(tensor)
        name = group.group_name
        if name in buffer.groups:
            return
        if name not in self._prepared:
            self.memory.prepare(group)
            self._prepared.add(name)
        self.memory.rendezvous(buffer.tensor, group)
        buffer.groups.add(name)
        self.rendezvous_count += 1

    def release(self, tensor: torch.Tensor) -> None:
        """Give a buffer back once its contents were read (on the current stream).

        Args:
            tensor: a buffer from :meth:`acquire`.
        """
        buffer = self._owner(tensor)
        self._in_use.remove(buffer)
        buffer.released = current_stream(self.device.type).record_event()
        key = (buffer.tensor.dtype, buffer.tensor.numel())
        self._free.setdefault(key, []).append(buffer)

    def _owner(self, tensor: torch.Tensor) -> _PooledBuffer:
        ptr = tensor.untyped_storage().data_ptr()
        for buffer in self._in_use:
            if buffer.tensor.untyped_storage().data_ptr() == ptr:
                return buffer
        raise ValueError(
            "expected a buffer acquired from this symmetric buffer pool and not yet released, "
            f"got a tensor of shape {tuple(tensor.shape)} at another address"
        )


class SymmetricBufferPools:
    """The pools of one communication context, per (memory, device), held weakly.

    A pool lives while an all-gather uses it; units configured with equal memories share it.
    """

    def __init__(self) -> None:
        self._pools: weakref.WeakValueDictionary[tuple[Any, torch.device], SymmetricBufferPool]
        self._pools = weakref.WeakValueDictionary()

    def pool(self, memory: SymmetricMemory, device: torch.device) -> SymmetricBufferPool:
        """The pool of ``memory`` on ``device``, created on first use.

        Args:
            memory: where buffers come from.
            device: their device.

        Returns:
            The pool.
        """
        key = (memory, device)
        pool = self._pools.get(key)
        if pool is None:
            pool = SymmetricBufferPool(memory, device)
            self._pools[key] = pool
        return pool


class SymmetricMemoryAllGather(DefaultAllGather):
    """A unit's all-gather into pooled symmetric buffers.

    Args:
        memory: where buffers come from.
        pools: the current pools of the unit's root (looked up per all-gather, since a unit
            joins its root's communication context at lazy initialization).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.SymmMemAllGather`.
    """

    def __init__(self, memory: SymmetricMemory, pools: Callable[[], SymmetricBufferPools]) -> None:
        self.memory = memory
        self._pools = pools
        #: The pool of the last allocation (held, so the pool lives while this is installed).
        self.pool: SymmetricBufferPool | None = None

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A pooled buffer for the all-gather output (acquired on the current stream)."""
        self.pool = self._pools().pool(self.memory, device)
        numel = math.prod(int(s) for s in size)
        return self.pool.acquire(numel, dtype).view([int(s) for s in size])

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """All-gather in place into the pooled output (rendezvoused with ``group`` once)."""
        assert self.pool is not None, "allocate() comes before the all-gather"
        self.pool.rendezvous(output_tensor, group)
        work: dist.Work | None = dist.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=async_op
        )
        return work

    def release(self, buffer: torch.Tensor) -> None:
        """Give the output buffer back to its pool once it was copied out."""
        assert self.pool is not None, "allocate() comes before release()"
        self.pool.release(buffer)
