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
    """One hop around a ring: send to the next rank of ``group``, receive from the previous."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self._pending: list[Any] = []
        self._received: list[torch.Tensor] = []

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        """Issue the sends of ``tensors`` and the receives of the previous rank's (async)."""
        if self._pending:
            raise RuntimeError("RingExchange.start called while a previous hop is in flight")
        self._received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_rank, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in self._received]
        self._pending = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Wait for the hop started last and return the tensors received."""
        for work in self._pending:
            work.wait()
        self._pending = []
        received, self._received = self._received, []
        return received


def _group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


class _SeqHeadsAllToAll(torch.autograd.Function):
    """``[B, H, s, D]`` (sequence shard) <-> ``[B, H/n, n*s, D]`` (head shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_to_all(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


def _all_to_all(x: torch.Tensor, group: ProcessGroup, to_heads: bool) -> torch.Tensor:
    n = _group_size(group)
    b, h, s, d = x.shape
    if to_heads:
        # Send head group j to rank j; receive rank j's sequence shard of my head group.
        send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
    # Inverse: send sequence shard j back to rank j; receive head group j from rank j.
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * h, s // n, d)


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Ulysses forward exchange: ``[B, H, s, D]`` to ``[B, H/n, n*s, D]`` (rank order)."""
    out: torch.Tensor = _SeqHeadsAllToAll.apply(x, group, True)  # type: ignore[no-untyped-call]
    return out


def heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Ulysses backward exchange: ``[B, h, n*s, D]`` to ``[B, n*h, s, D]``."""
    out: torch.Tensor = _SeqHeadsAllToAll.apply(x, group, False)  # type: ignore[no-untyped-call]
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = _group_size(group)
        b, h, s, d = x.shape
        out = torch.empty((n * b, h, s, d), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(n, b, h, s, d).permute(1, 2, 0, 3, 4).reshape(b, h, n * s, d)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = _group_size(ctx.group)
        b, h, ns, d = grad.shape
        send = grad.reshape(b, h, n, ns // n, d).permute(2, 0, 1, 3, 4).reshape(n * b, h, -1, d)
        out = torch.empty((b, h, ns // n, d), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, send.contiguous(), group=ctx.group)
        return out, None


def gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``[B, H, s, D]`` along the sequence into ``[B, H, n*s, D]`` (rank order)."""
    out: torch.Tensor = _GatherSeq.apply(x, group)  # type: ignore[no-untyped-call]
    return out
