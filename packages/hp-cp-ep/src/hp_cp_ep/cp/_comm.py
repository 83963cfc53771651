"""Communication of context parallelism: the ring exchange and two differentiable collectives.

* :class:`RingExchange` passes tensors one hop around a process group with point-to-point
  operations (``dist.batch_isend_irecv``) and returns at once; :meth:`RingExchange.wait` gives
  the received tensors. The ring engine starts the next hop before computing the current block.
* :func:`seq_to_heads` / :func:`heads_to_seq`: Ulysses' ``all_to_all_single`` between a sequence
  shard with all heads and the whole group's sequence with a slice of the heads (each is the
  other's backward).
* :func:`gather_seq`: all-gather along the sequence; its backward reduce-scatters (sums) the
  gradient back to the owners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class RingExchange:
    """One hop around a ring: send to the next rank of ``group``, receive from the previous.

    Two exchanges in flight on one group (K/V and dK/dV in the backward) use different ``tag``s
    so that their messages cannot be matched to each other's receives. ``shift`` (keyword-only)
    sends ``shift`` ranks ahead and receives from ``shift`` ranks behind instead (a ring cut
    short returns its gradient accumulators to their owners in one such hop).
    """

    def __init__(self, group: ProcessGroup, tag: int = 0, *, shift: int = 1) -> None:
        self.group, self.tag = group, tag
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + shift) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - shift) % size)
        self._pending: list[Any] = []
        self._received: list[torch.Tensor] = []
        self._sending: list[torch.Tensor] = []

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        """Issue the sends of ``tensors`` and the receives of the previous rank's (async)."""
        if self._pending:
            raise RuntimeError("RingExchange.start called while a previous hop is in flight")
        self._received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        self._sending = [t.contiguous() for t in tensors]  # alive until the hop completes
        ops = [
            dist.P2POp(dist.isend, t, self.next_rank, self.group, self.tag) for t in self._sending
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.prev_rank, self.group, self.tag) for t in self._received
        ]
        self._pending = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Wait for the hop started last and return the tensors received."""
        for work in self._pending:
            work.wait()
        self._pending, self._sending = [], []
        received, self._received = self._received, []
        return received


def _group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _a2a_send(x: torch.Tensor, n: int, to_heads: bool) -> torch.Tensor:
    b, h, s, d = x.shape
    if to_heads:  # head group j goes to rank j
        return x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    # sequence shard j goes back to rank j
    return x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()


def _a2a_result(recv: torch.Tensor, to_heads: bool) -> torch.Tensor:
    n, b, h, s, d = recv.shape
    if to_heads:  # recv[j]: rank j's sequence shard of my head group
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h, n * s, d)
    # recv[j]: head group j of my sequence shard
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * h, s, d)


def _all_to_all_many(
    xs: Sequence[torch.Tensor], group: ProcessGroup, to_heads: bool
) -> tuple[torch.Tensor, ...]:
    """Issue every tensor's all-to-all at once, then wait for all of them."""
    n = _group_size(group)
    sends = [_a2a_send(x, n, to_heads) for x in xs]
    recvs = [torch.empty_like(s) for s in sends]
    works = [
        dist.all_to_all_single(r, s, group=group, async_op=True)
        for r, s in zip(recvs, sends, strict=True)
    ]
    for work in works:
        work.wait()
    return tuple(_a2a_result(r, to_heads) for r in recvs)


class _SeqHeadsAllToAll(torch.autograd.Function):
    """``[B, H, s, D]`` (sequence shard) <-> ``[B, H/n, n*s, D]`` (head shard), k tensors."""

    @staticmethod
    def forward(
        ctx: Any, group: ProcessGroup, to_heads: bool, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.to_heads = group, to_heads
        return _all_to_all_many(xs, group, to_heads)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _all_to_all_many([g.contiguous() for g in grads], ctx.group, not ctx.to_heads)
        return (None, None, *back)


def _exchange(
    fn: Any, xs: Sequence[torch.Tensor], group: ProcessGroup, concurrent: bool, *flags: Any
) -> list[torch.Tensor]:
    if concurrent:
        return list(fn.apply(group, *flags, *xs))
    return [fn.apply(group, *flags, x)[0] for x in xs]


def seq_to_heads(
    xs: Sequence[torch.Tensor], group: ProcessGroup, *, concurrent: bool = False
) -> list[torch.Tensor]:
    """Ulysses exchange: each ``[B, H, s, D]`` to ``[B, H/n, n*s, D]`` (sequence in rank order).

    ``concurrent`` issues all tensors' all-to-alls before waiting for any (else one by one).
    """
    return _exchange(_SeqHeadsAllToAll, xs, group, concurrent, True)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Inverse Ulysses exchange: ``[B, h, n*s, D]`` to ``[B, n*h, s, D]``."""
    return _exchange(_SeqHeadsAllToAll, [x], group, False, False)[0]


def _gather_many(xs: Sequence[torch.Tensor], group: ProcessGroup) -> tuple[torch.Tensor, ...]:
    n = _group_size(group)
    outs = [torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device) for x in xs]
    works = [
        dist.all_gather_single(o, x.contiguous(), group=group, async_op=True)
        for o, x in zip(outs, xs, strict=True)
    ]
    for work in works:
        work.wait()
    results = []
    for o, x in zip(outs, xs, strict=True):
        b, h, s, d = x.shape
        results.append(o.view(n, b, h, s, d).permute(1, 2, 0, 3, 4).reshape(b, h, n * s, d))
    return tuple(results)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return _gather_many(xs, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        n = _group_size(ctx.group)
        outs, works = [], []
        for grad in grads:
            b, h, ns, d = grad.shape
            send = grad.reshape(b, h, n, ns // n, d).permute(2, 0, 1, 3, 4)
            out = torch.empty((b, h, ns // n, d), dtype=grad.dtype, device=grad.device)
            flat = send.reshape(n * b, h, ns // n, d).contiguous()
            works.append(dist.reduce_scatter_single(out, flat, group=ctx.group, async_op=True))
            outs.append(out)
        for work in works:
            work.wait()
        return (None, *outs)


def gather_seq(
    xs: Sequence[torch.Tensor], group: ProcessGroup, *, concurrent: bool = False
) -> list[torch.Tensor]:
    """All-gather each ``[B, H, s, D]`` along the sequence into ``[B, H, n*s, D]`` (rank order).

    The backward reduce-scatters (sums) the gradients back to their owners.
    """
    return _exchange(_GatherSeq, xs, group, concurrent)
