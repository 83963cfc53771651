"""Gradients of parameters tied across stages: found once, reduced over the ranks that hold them.

At set-up (the first step) every pipeline rank describes its ties (a hash of the tie name, the
number of elements and the dtype) in a small int64 tensor on the stage's device; two
``all_gather`` calls over the pipeline group tell every rank which ranks hold each tie. A tie
held by one rank only (both copies there, as on the V placement) is summed locally, with no
communication; otherwise a process group of just its holders is created once
(``new_group(..., use_local_synchronization=True)``: only the holders take part) and each step
all-reduces the summed gradient of the tie over it: one collective of the tie's size per tie,
nothing for the other ranks (Megatron's embedding group).

See Also:
    :pt:`torch.distributed.new_group`
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_pp.stage import PipelineStage

_ROW = 3  # name hash, numel, dtype hash


def _hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class TiedGradients:
    """The tie groups of one pipeline and the per-step reduction of tied gradients.

    Args:
        stages: This rank's stages.
        group: The pipeline process group (``None``: the world).

    Raises:
        ValueError: two ranks declare the same tie with different sizes or dtypes.

    Attributes:
        collectives: All-reduces issued so far by :meth:`reduce`.
        bytes_reduced: Bytes of the tensors those all-reduces carried.
    """

    def __init__(self, stages: Sequence[PipelineStage], group: dist.ProcessGroup | None) -> None:
        self.stages = list(stages)
        self.group = group
        self.local: dict[str, list[torch.nn.Parameter]] = {}
        for stage in self.stages:
            params = dict(stage.submod.named_parameters())
            for fqn, tie in stage.tied_parameters.items():
                self.local.setdefault(tie, []).append(params[fqn])
        self.collectives = 0
        self.bytes_reduced = 0
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        self.holders: dict[str, tuple[int, ...]] = {}
        self._discover()

    def _discover(self) -> None:
        device = self.stages[0].device
        size = dist.get_world_size(self.group)
        ties = sorted(self.local)
        count = torch.tensor([len(ties)], dtype=torch.int64).to(device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=self.group)
        most = max(int(c.item()) for c in counts)
        if most == 0:
            return
        rows = torch.zeros(most, _ROW, dtype=torch.int64).to(device)
        for i, tie in enumerate(ties):
            param = self.local[tie][0]
            rows[i, 0] = _hash(tie)
            rows[i, 1] = param.numel()
            rows[i, 2] = _hash(str(param.dtype))
        gathered = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(gathered, rows, group=self.group)
        table = [g.cpu().tolist() for g in gathered]
        me = dist.get_rank(self.group)
        by_rank: dict[int, dict[int, tuple[int, int]]] = {
            r: {row[0]: (row[1], row[2]) for row in table[r][: int(counts[r].item())]}
            for r in range(size)
        }
        for tie in ties:
            key = _hash(tie)
            mine = by_rank[me][key]
            holders = tuple(r for r in range(size) if key in by_rank[r])
            for r in holders:
                if by_rank[r][key] != mine:
                    raise ValueError(
                        f"tie {tie!r}: pipeline rank {me} holds {mine[0]} elements but rank {r} "
                        f"holds {by_rank[r][key][0]} (or another dtype): tied parameters must "
                        "have one shape and dtype"
                    )
            self.holders[tie] = holders
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for holders in sorted(set(self.holders.values())):
            if len(holders) == 1:
                made[holders] = None
                continue
            ranks = [
                r if self.group is None else dist.get_global_rank(self.group, r) for r in holders
            ]
            made[holders] = dist.new_group(ranks, use_local_synchronization=True)
        self.groups = {tie: made[h] for tie, h in self.holders.items()}

    def reduce(self) -> None:
        """Give every copy of each tie the sum of the tie's gradients over all its copies."""
        for tie in sorted(self.local):
            params = self.local[tie]
            grads = [p.grad for p in params if p.grad is not None]
            total: Any = (
                torch.zeros_like(params[0]) if not grads else sum(grads[1:], grads[0].clone())
            )
            tie_group = self.groups.get(tie)
            if tie_group is not None:
                dist.all_reduce(total, group=tie_group)
                self.collectives += 1
                self.bytes_reduced += total.numel() * total.element_size()
            for p in params:
                p.grad = total.clone() if len(params) > 1 else total
