"""The fused collectives of one unit: one all-gather to unshard, one reduce-scatter to reduce.

Buffers are packed and unpacked by hp-kernels' copy-in/copy-out ops in PyTorch FSDP2's layout,
and the collectives are issued through ``torch.distributed.all_gather_single`` /
``reduce_scatter_single`` / ``all_reduce`` (looked up at call time, so a test can wrap them).
Collectives are issued with ``async_op=True``: on every backend the returned work handle is what
the runtime waits on, so communication overlaps computation on the CPU (gloo's worker threads)
and on accelerators (the backend's own stream).

All-gather buffers are freed by event waits, never ``record_stream``: after a unit's copy-out
the compute stream records an event, and before the buffer is dropped the copy-in and
all-gather streams wait for it (:class:`AllGatherState`), so the caching allocator may hand the
memory to the next all-gather at once, and that all-gather's copy-in cannot start before the
copy-out it would overwrite. In forward the newest gathered unit's state is kept until the next
unit's copy-out (its copy-out overlaps the next all-gather): at most two all-gathers in flight
per root however far the host runs ahead, as in PyTorch's FSDP2.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives`: PyTorch's FSDP2 collectives.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dtensor.device import Event
from hp_dtensor.device import stream as device_stream
from hp_fsdp._profiling import NO_OP
from hp_fsdp._torch_compat import local_tensor, no_grad_call, unsafe_preserve_version_counter
from hp_fsdp.streams import CommStreams
from hp_kernels import (
    AllGather,
    DefaultAllGather,
    DefaultReduceScatter,
    ReduceScatter,
    all_gather_copy_in,
    all_gather_copy_out,
    gradient_divide_factors,
    reduce_scatter_copy_in,
)

__all__ = [
    "AllGatherResult",
    "AllGatherState",
    "ProcessGroupAllGather",
    "ProcessGroupReduceScatter",
    "ReleasesBuffers",
    "apply_gradient_scaling_factor",
    "discard_all_gather",
    "divide_factors",
    "issue_all_gather",
    "issue_reduce_scatter",
    "owned_storage",
    "pg_allocate",
    "pg_supports_alloc",
    "reduce_scatter_in_place",
    "wait_all_gather",
]

_NO_STREAM = NO_OP

#: Backends whose reduce-scatter may write its output into its own input: NCCL documents the
#: in-place layout (``output == input + rank * numel``); gloo's is verified by the tests. Every
#: other backend (HCCL, torch's threaded and fake test groups, a user's backend) gets a separate
#: output buffer: the threaded group, for one, writes rank 0's output before the other ranks
#: have read their inputs.
_IN_PLACE_REDUCE_SCATTER_BACKENDS = frozenset({"nccl", "gloo"})


def reduce_scatter_in_place(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a reduce-scatter over ``group`` may write into its own input's row.

    Args:
        group: the process group.
        device: the device of the buffers (picks the backend of a multi-device group).

    Returns:
        True for NCCL and gloo, False for every other backend.
    """
    try:
        name = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False
    if ":" in name:  # "cpu:gloo,cuda:nccl": the backend of this device
        per_device = dict(part.split(":", 1) for part in name.split(","))
        name = per_device.get(device.type, "")
    return name.lower() in _IN_PLACE_REDUCE_SCATTER_BACKENDS


@runtime_checkable
class ReleasesBuffers(Protocol):
    """A custom all-gather whose output buffers are lent and must be given back once read."""

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer from ``allocate`` after its contents were copied out."""
        ...


@dataclass
class AllGatherResult:
    """An issued all-gather: its flat output buffer, split sizes and work handle.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.AllGatherResult`.
    """

    output: torch.Tensor
    split_sizes: list[int]
    world_size: int
    work: dist.Work | None
    #: Recorded on the all-gather stream after the collective was issued (None: no streams).
    event: Event | None = None
    #: Gives ``output`` back to its lender once read (a pooled buffer; None: nothing to do).
    release: Callable[[], None] | None = None


@no_grad_call
def issue_all_gather(
    inputs: Sequence[torch.Tensor],
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    device: torch.device,
    async_op: bool,
    comm: AllGather | None = None,
    *,
    streams: CommStreams | None = None,
) -> AllGatherResult:
    """Pack ``inputs`` (cast to ``dtype``) and issue one all-gather over ``group``.

    Args:
        inputs: this rank's flat shards, one per parameter.
        dtype: the communication (compute) dtype.
        group: the process group.
        world_size: its size.
        rank: this rank's index in it.
        device: the device of the buffers.
        async_op: return before the collective completes.
        comm: a custom all-gather (``set_custom_all_gather``); its ``allocate`` provides the
            output buffer. None uses ``torch.distributed.all_gather_single``.
        streams: copy in on the copy-in stream (after the compute stream), issue on the
            all-gather stream after the copy-in event; None: the current stream.

    Returns:
        The pending :class:`AllGatherResult`.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_all_gather`.
    """
    splits = [t.numel() for t in inputs]
    release: Callable[[], None] | None = None
    with _NO_STREAM if streams is None else device_stream(streams.copy_in):
        if streams is not None:
            # Shards come from the compute stream, which the copy-in stream waited for at the
            # root's pre-forward; they are released only after the compute stream waited for
            # this all-gather's event (its copy-out), so no ``record_stream`` is needed.
            streams.mark("all_gather_copy_in")
        if world_size == 1:  # nothing to gather (replicate-only mesh): pack, no collective
            _, ag_output = all_gather_copy_in(inputs, splits, 1, 0, dtype, device)
        elif comm is None:
            ag_input, ag_output = all_gather_copy_in(
                inputs, splits, world_size, rank, dtype, device
            )
        else:
            buffer = comm.allocate((world_size * sum(splits),), dtype=dtype, device=device)
            if isinstance(comm, ReleasesBuffers):
                release = functools.partial(comm.release, buffer)
            ag_input, ag_output = all_gather_copy_in(
                inputs, splits, world_size, rank, dtype, device, out=buffer
            )
        if streams is not None:
            streams.track(ag_output, "all_gather_output")
    if streams is None:
        event = None
    else:
        event = streams.copy_in.record_event(streams.new_event("all_gather_copy_in"))
    if world_size == 1:
        return AllGatherResult(ag_output, splits, 1, None, event, release)
    with _NO_STREAM if streams is None else device_stream(streams.all_gather):
        if streams is not None:
            assert event is not None
            streams.all_gather.wait_event(event)
            streams.mark("all_gather")
        if comm is None:
            work = dist.all_gather_single(ag_output, ag_input, group=group, async_op=async_op)
        else:
            work = comm(ag_output, ag_input, group, async_op)
        if streams is not None:
            work = streams.order_on_stream(work)
    if streams is not None:
        event = streams.all_gather.record_event(streams.new_event("all_gather"))
    return AllGatherResult(
        ag_output, splits, world_size, work if async_op else None, event, release
    )


@no_grad_call
def wait_all_gather(result: AllGatherResult, outs: Sequence[torch.Tensor]) -> None:
    """Wait for an all-gather and copy its output into one flat tensor per parameter.

    The outputs are storages autograd may have saved views of (the unsharded parameters), so
    their version counters are preserved: the copy refills freed storage, it does not modify a
    live value.

    Args:
        result: the pending all-gather.
        outs: one contiguous flat tensor of ``world_size * split`` elements per parameter.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_all_gather_copy_out`.
    """
    if result.work is not None:
        result.work.wait()
        result.work = None
    if result.event is not None:  # the current (compute) stream waits for the all-gather only
        result.event.wait()
        result.event = None
    with unsafe_preserve_version_counter(tuple(outs)):
        all_gather_copy_out(result.output, result.split_sizes, result.world_size, outs)
    if result.release is not None:  # read on the current stream: the buffer can be reused
        result.release()
        result.release = None


def discard_all_gather(result: AllGatherResult, streams: CommStreams | None = None) -> None:
    """Wait for an all-gather whose output will not be used, and give its buffer back.

    The compute stream (which frees the inputs) and the copy-in stream (which reuses the
    output's memory) wait for the all-gather's event: the buffer is freed by event waits.

    Args:
        result: the pending all-gather.
        streams: the root's streams (None: only the current stream waits).
    """
    if result.work is not None:
        result.work.wait()
        result.work = None
    if result.event is not None:
        result.event.wait()
        if streams is not None:
            streams.copy_in.wait_event(result.event)
        result.event = None
    if result.release is not None:
        result.release()
        result.release = None


@dataclass
class AllGatherState:
    """Gathered buffers already copied out, kept until the streams that reuse them wait.

    ``event`` is recorded on the compute stream after the copy-out. :meth:`free` makes the
    copy-in and all-gather streams wait for it and drops the buffers, so the caching allocator
    reuses their memory for a later all-gather only once the copy-out has run, without
    ``record_stream`` and without a host wait.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.AllGatherState`.
    """

    results: list[AllGatherResult]
    event: Event

    def free(self, streams: CommStreams) -> None:
        """Order the all-gather streams after the copy-out and drop the buffers.

        Args:
            streams: the root's streams.
        """
        streams.copy_in.wait_event(self.event)
        streams.all_gather.wait_event(self.event)
        self.results.clear()


def divide_factors(
    reduce_dtype: torch.dtype,
    shard_size: int,
    replicate_size: int = 1,
    factor: float | None = None,
    force_sum: bool = False,
) -> tuple[float | None, float | None, dist.ReduceOp.RedOpType, dist.ReduceOp.RedOpType]:
    """How a reduction divides gradients, as torch FSDP2 does (without ``PREMUL_SUM``).

    fp32 and bf16 with no custom factor reduce with ``AVG`` (no extra division). A custom
    ``factor`` equal to the shard size averages the reduce-scatter and sums the all-reduce;
    any other custom factor sums and divides the result by ``factor`` (torch would pre-multiply
    with ``PREMUL_SUM``, which gloo and hccl lack). With ``force_sum`` or another reduce dtype
    (fp16) every collective sums; fp16 divides by a power of two near the square root of the
    factor before the sum and by the rest after it, to avoid overflow and underflow.

    Args:
        reduce_dtype: the dtype of the reduction.
        shard_size: the size of the shard axis.
        replicate_size: the size of the replicate axis (1 for FSDP).
        factor: the custom gradient divide factor (None: the data-parallel size).
        force_sum: reduce with ``SUM`` only and divide locally.

    Returns:
        ``(pre_divide, post_divide, reduce_scatter_op, all_reduce_op)``; None means no
        division.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors`.
    """
    data_parallel_size = shard_size * replicate_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    sum_op = dist.ReduceOp.SUM
    if not overflow_risk and not force_sum:
        if factor is None:
            if data_parallel_size == 1:
                return None, None, sum_op, sum_op
            return None, None, dist.ReduceOp.AVG, dist.ReduceOp.AVG
        if factor == shard_size and shard_size > 1:
            return None, None, dist.ReduceOp.AVG, sum_op
        return None, (None if factor == 1 else float(factor)), sum_op, sum_op
    if factor is None:
        factor = float(data_parallel_size)
    pre, post = gradient_divide_factors(data_parallel_size, reduce_dtype, factor)
    return (
        None if pre is None or pre == 1 else float(pre),
        None if post is None or post == 1 else float(post),
        sum_op,
        sum_op,
    )


@no_grad_call
def issue_reduce_scatter(
    grads: list[torch.Tensor],
    shard_dims: Sequence[int],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    world_size: int,
    op: dist.ReduceOp.RedOpType,
    pre_divide: float | None,
    comm: ReduceScatter | None = None,
    *,
    in_place: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
    """Pack gradients in torch's layout and issue one reduce-scatter (``grads`` is cleared).

    Args:
        grads: the unsharded gradients, in parameter order; emptied so they can be freed.
        shard_dims: each gradient's shard dim.
        reduce_dtype: the reduce dtype (gradients are cast while packing).
        group: the shard process group.
        world_size: its size.
        op: the reduce op.
        pre_divide: divide the packed input by this before the collective.
        comm: a custom reduce-scatter (``set_custom_reduce_scatter``); its ``allocate``
            provides the output buffer. None uses ``torch.distributed.reduce_scatter_single``.
        in_place: write the output into this rank's row of the input (None: where
            :func:`reduce_scatter_in_place` says the backend allows it).

    Returns:
        ``(input, output, work)``: keep ``input`` alive until ``work`` completes. Without
        ``comm`` on NCCL or gloo, ``output`` is this rank's row of ``input`` (see
        :func:`owned_storage`).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce`.
    """
    rs_input = reduce_scatter_copy_in(
        grads, shard_dims, world_size, reduce_dtype, predivide_factor=pre_divide
    )
    grads.clear()
    numel = rs_input.numel() // world_size
    if world_size == 1:
        return rs_input, rs_input.view(-1), None
    if comm is None:
        if in_place is None:
            in_place = reduce_scatter_in_place(group, rs_input.device)
        if in_place:
            # This rank's row of the input receives the reduced shard (gloo and NCCL accept
            # ``output == input + rank * numel``), so an in-flight reduction holds one buffer,
            # as PyTorch's does once its post-reduce has run, not an input and an output.
            rs_output = rs_input.view(world_size, numel)[dist.get_rank(group)]
        else:
            rs_output = torch.empty(numel, dtype=rs_input.dtype, device=rs_input.device)
        work = dist.reduce_scatter_single(rs_output, rs_input, group=group, op=op, async_op=True)
    else:
        rs_output = comm.allocate((numel,), dtype=reduce_dtype, device=rs_input.device)
        work = comm(rs_output, rs_input, group, op, True)
    return rs_input, rs_output, work


def owned_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it spans its whole storage, else a copy (frees a larger buffer).

    A reduced shard that outlives its reduction (a new ``.grad``, a partial reduction kept
    across micro-batches) must not keep the whole in-place reduce-scatter buffer alive.
    """
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def apply_gradient_scaling_factor(
    grad: torch.Tensor, factor: float | torch.Tensor | None
) -> torch.Tensor:
    """Multiply a reduced gradient by ``factor`` in place (``set_gradient_scaling_factor``).

    The engine applies a unit's factor after the reduction and division; this is that step,
    for gradients reduced outside a unit. A tensor factor is read now (so it may change
    between steps); None leaves ``grad`` untouched at no cost.

    Args:
        grad: a gradient (plain tensor or DTensor), modified in place.
        factor: None, a number, or a one-element tensor.

    Returns:
        ``grad``.

    Raises:
        ValueError: for a tensor factor with more than one element.

    See Also:
        :pt:`torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor`: PyTorch's nearest
        counterpart (a divisor applied through the collective).
    """
    if factor is None:
        return grad
    target = local_tensor(grad) if isinstance(grad, DTensor) else grad
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(
                f"a tensor gradient scaling factor must have one element, got {tuple(factor.shape)}"
            )
        target.mul_(factor.to(device=target.device, dtype=target.dtype))
    else:
        target.mul_(float(factor))
    return grad


def pg_allocate(
    group: dist.ProcessGroup,
    size: Sequence[int | torch.SymInt],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A communication buffer from the process group's allocator (an ordinary one without).

    Args:
        group: the process group.
        size: the buffer's shape.
        dtype: its dtype.
        device: its device.

    Returns:
        The buffer.

    See Also:
        :pt:`torch.distributed.fsdp.FSDPModule.set_allocate_memory_from_process_group_for_comm`.
    """
    backend = group._get_backend(device)
    if backend.supports_tensor_alloc(device):
        numel = math.prod(int(s) for s in size)
        return backend.allocate_tensor(numel, dtype=dtype, device=device)
    return torch.empty(*size, dtype=dtype, device=device)


def pg_supports_alloc(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the process group's backend allocates tensors for ``device``.

    Args:
        group: the process group.
        device: the device.

    Returns:
        True when it has an allocator.
    """
    try:
        return bool(group._get_backend(device).supports_tensor_alloc(device))
    except (RuntimeError, NotImplementedError):
        return False


class ProcessGroupAllGather(DefaultAllGather):
    """All-gather whose buffers come from the process group's allocator."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return pg_allocate(self._group, size, dtype, device)


class ProcessGroupReduceScatter(DefaultReduceScatter):
    """Reduce-scatter whose buffers come from the process group's allocator."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return pg_allocate(self._group, size, dtype, device)
