"""Communication interfaces for sharding runtimes, with the call contract of PyTorch FSDP2's.

:class:`AllGather` and :class:`ReduceScatter` have exactly the ``allocate`` / ``__call__``
signatures of ``torch.distributed.fsdp``'s custom-communication hooks
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). PyTorch's own classes
count as virtual subclasses (checked lazily, without importing ``torch.distributed.fsdp``), so
``isinstance(torch_comm, hp_kernels.AllGather)`` holds and a runtime typed against ours accepts
them; in the other direction, our implementations duck-type as torch's and can be handed to
torch's ``fully_shard`` modules. :class:`AllReduce` extends the same pattern to the
replicate-axis all-reduce of HSDP.

Implementations: :class:`DefaultAllGather`, :class:`DefaultReduceScatter`,
:class:`DefaultAllReduce` (plain process-group collectives into ``torch.empty`` buffers) and
:class:`Bf16AllToAllReduceScatter` (bfloat16 on the wire, float32 accumulation).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist

__all__ = [
    "AllGather",
    "AllReduce",
    "Bf16AllToAllReduceScatter",
    "Comm",
    "DefaultAllGather",
    "DefaultAllReduce",
    "DefaultReduceScatter",
]

ReduceOpLike = Any  # dist.ReduceOp or dist.ReduceOp.RedOpType, as in torch's contract


class Comm(ABC):
    """A communication primitive: how and where its buffers are allocated, and the call.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_api.Comm`: PyTorch FSDP2's interface.
    """

    #: Name of PyTorch FSDP2's interface class this one mirrors; its subclasses count as ours.
    _torch_interface: ClassVar[str] = "Comm"

    @classmethod
    def __subclasshook__(cls, candidate: type) -> Any:
        """Accept subclasses of the PyTorch FSDP2 interface this class mirrors (virtual subclasses).

        Only the interface classes themselves (``Comm``, ``AllGather``, ``ReduceScatter``,
        ``AllReduce``) answer; their subclasses use the normal check.

        Args:
            candidate: The class being checked.

        Returns:
            True for subclasses of the matching torch interface,
            else ``NotImplemented`` (the normal check applies).

        See Also:
            ``abc.ABCMeta.__subclasshook__``: the protocol implemented.
        """
        name = cls.__dict__.get("_torch_interface")
        if name is not None and _is_torch_subclass(candidate, name):
            return True
        return NotImplemented

    @abstractmethod
    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Allocate a communication buffer.

        Args:
            size: Shape of the buffer.
            dtype: Its dtype.
            device: Its device.

        Returns:
            The (uninitialized) buffer.

        See Also:
            :pt:`torch.distributed.fsdp._fully_shard._fsdp_api.Comm.allocate`: PyTorch's hook.
        """


class AllGather(Comm):
    """All-gather of equal-sized flat inputs into one flat output (rank-major).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`: PyTorch FSDP2's interface.
    """

    _torch_interface: ClassVar[str] = "AllGather"

    allocate = Comm.allocate  # documented here too; still abstract

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather ``input_tensor`` from every rank of ``group`` into ``output_tensor``.

        Args:
            output_tensor: Flat buffer of ``group.size() * input_tensor.numel()`` elements.
            input_tensor: This rank's flat input.
            group: Process group.
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None`` (or a completed handle).

        See Also:
            :pt:`torch.distributed.all_gather_single`: the collective used by default.
        """


class ReduceScatter(Comm):
    """Reduce-scatter of a flat input into a flat per-rank output.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter`: PyTorch FSDP2's
        interface.
    """

    _torch_interface: ClassVar[str] = "ReduceScatter"

    allocate = Comm.allocate  # documented here too; still abstract

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` over ``group`` and scatter equal slices.

        Args:
            output_tensor: Flat buffer of ``input_tensor.numel() // group.size()`` elements.
            input_tensor: Flat input, rank-major (slice ``r`` goes to rank ``r``).
            group: Process group.
            op: Reduction (``dist.ReduceOp.SUM``, ``AVG``, ...).
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None`` (or a completed handle).

        See Also:
            :pt:`torch.distributed.reduce_scatter_single`: the collective used by default.
        """


class AllReduce(Comm):
    """In-place all-reduce (the replicate-axis reduction of HSDP, or DDP-style replication).

    See Also:
        :pt:`torch.distributed.all_reduce`: the collective it wraps by default.
    """

    allocate = Comm.allocate  # documented here too; still abstract

    @abstractmethod
    def __call__(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``tensor`` over ``group`` in place.

        Args:
            tensor: Tensor reduced in place.
            group: Process group.
            op: Reduction.
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None`` (or a completed handle).

        See Also:
            :pt:`torch.distributed.all_reduce`: PyTorch's collective.
        """


_TORCH_API = "torch.distributed.fsdp._fully_shard._fsdp_api"


def _is_torch_subclass(candidate: type, name: str) -> bool:
    """Whether ``candidate`` derives from torch FSDP2's class ``name`` (if torch loaded it).

    Looked up in ``sys.modules`` rather than imported: importing ``torch.distributed.fsdp`` costs
    seconds, and a class deriving from torch's exists only once torch's module is loaded.
    """
    api = sys.modules.get(_TORCH_API)
    base = getattr(api, name, None) if api is not None else None
    return isinstance(base, type) and issubclass(candidate, base)


def _allocate_empty(
    self: Comm,
    size: Sequence[int | torch.SymInt],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Allocate an uninitialized buffer with ``torch.empty``.

    Args:
        size: Shape of the buffer.
        dtype: Its dtype.
        device: Its device.

    Returns:
        The new buffer.

    See Also:
        :pt:`torch.empty`: the allocation used.
    """
    return torch.empty(*size, dtype=dtype, device=device)


class DefaultAllGather(AllGather):
    """All-gather with ``torch.distributed.all_gather_single`` into ``torch.empty`` buffers.

    Example:
        >>> from hp_kernels import DefaultAllGather
        >>> comm = DefaultAllGather()  # then comm(out, inp, group) on every rank

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather`: PyTorch's.
    """

    allocate = _allocate_empty

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather ``input_tensor`` from all ranks into ``output_tensor``.

        Args:
            output_tensor: Flat output, ``group.size()`` times the input's size.
            input_tensor: Flat input.
            group: Process group.
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None``.

        See Also:
            :pt:`torch.distributed.all_gather_single`: the collective.
        """
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return cast("dist.Work | None", work)


class DefaultReduceScatter(ReduceScatter):
    """Reduce-scatter with ``torch.distributed.reduce_scatter_single``.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultReduceScatter`:
        PyTorch's.
    """

    allocate = _allocate_empty

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` and scatter slices into ``output_tensor``.

        Args:
            output_tensor: This rank's flat output slice.
            input_tensor: Flat rank-major input.
            group: Process group.
            op: Reduction.
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None``.

        See Also:
            :pt:`torch.distributed.reduce_scatter_single`: the collective.
        """
        work = dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
        return cast("dist.Work | None", work)


class DefaultAllReduce(AllReduce):
    """All-reduce with ``torch.distributed.all_reduce``.

    See Also:
        :pt:`torch.distributed.all_reduce`: the collective.
    """

    allocate = _allocate_empty

    def __call__(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        """All-reduce ``tensor`` in place.

        Args:
            tensor: Tensor reduced in place.
            group: Process group.
            op: Reduction.
            async_op: Return a work handle instead of waiting.

        Returns:
            The work handle when ``async_op``, else ``None``.

        See Also:
            :pt:`torch.distributed.all_reduce`: the collective.
        """
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return cast("dist.Work | None", work)


def _same_op(op: ReduceOpLike, kind: Any) -> bool:
    return bool(op == kind)


class _SumAfterWork(dist.Work):
    """Work handle that, once the all-to-all finishes, sums the received slices."""

    def __init__(self, inner: dist.Work, finish: Any) -> None:
        super().__init__()
        self._inner = inner
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            if timeout is None:
                self._inner.wait()
            else:
                self._inner.wait(timeout)
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


class Bf16AllToAllReduceScatter(ReduceScatter):
    """Reduce-scatter that sends bfloat16 and accumulates in float32.

    The input is cast to bfloat16 (round to nearest even), exchanged with one
    ``all_to_all_single`` (rank ``r`` receives every rank's slice ``r``), and the ``world_size``
    received slices are summed locally in float32, in rank order ``0 .. world_size-1``, then
    written to the output (cast to its dtype). Compared with a bfloat16 reduce-scatter, which
    rounds every partial sum to bfloat16, the only rounding is of each rank's contribution, so the
    error is at most ``world_size`` half-ulps of bfloat16 on the inputs (relative ``2**-9`` each)
    and never grows with the reduction order. Compared with a float32 reduce-scatter it halves
    the bytes on the wire. ``op`` may be ``SUM`` or ``AVG`` (true division by the world size
    after the float32 sum). The result is the same on every rank layout and independent of the
    backend's internal reduction order (bitwise reproducible).

    This is an opt-in transport: its bits differ from a float32 reduce-scatter.

    Example:
        >>> from hp_kernels import Bf16AllToAllReduceScatter
        >>> comm = Bf16AllToAllReduceScatter()  # model.set_custom_reduce_scatter(comm)

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultReduceScatter`:
        PyTorch's full-precision default.
    """

    allocate = _allocate_empty

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce-scatter ``input_tensor`` through a bfloat16 all-to-all.

        Args:
            output_tensor: This rank's flat output (float32 recommended).
            input_tensor: Flat rank-major input of ``group.size() * output_tensor.numel()``
                elements.
            group: Process group.
            op: ``dist.ReduceOp.SUM`` or ``dist.ReduceOp.AVG``.
            async_op: Return a handle whose ``wait()`` completes the exchange and the sum.

        Returns:
            A work handle when ``async_op``, else ``None``.

        Raises:
            ValueError: For another reduction or mismatched sizes.

        See Also:
            :pt:`torch.distributed.all_to_all_single`: the collective used.
        """
        average = _same_op(op, dist.ReduceOp.AVG)
        if not average and not _same_op(op, dist.ReduceOp.SUM):
            raise ValueError(f"Bf16AllToAllReduceScatter supports SUM and AVG, got {op}")
        world_size = group.size()
        n = output_tensor.numel()
        if input_tensor.numel() != world_size * n:
            raise ValueError(
                f"input has {input_tensor.numel()} elements, expected world_size * output "
                f"= {world_size * n}"
            )
        send = input_tensor.reshape(-1).to(torch.bfloat16)
        recv = torch.empty_like(send)

        def finish() -> None:
            acc = recv.view(world_size, n)[0].to(torch.float32)
            for r in range(1, world_size):
                acc.add_(recv.view(world_size, n)[r])
            if average:
                acc.div_(world_size)
            output_tensor.view(-1).copy_(acc)

        work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
        if async_op:
            if work is None:  # pragma: no cover - c10d always returns a handle for async ops
                raise RuntimeError("all_to_all_single(async_op=True) returned no work handle")
            return _SumAfterWork(work, finish)
        finish()
        return None
