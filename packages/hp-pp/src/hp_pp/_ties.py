"""Gradients of parameters tied across stages: found once, reduced over the ranks that hold them.

At set-up (the first step) every pipeline rank describes its ties (a hash of the tie name, the
number of elements and the dtype) in a small int64 tensor on the stage's device; two
``all_gather`` calls over the pipeline group tell every rank which ranks hold each tie. Each
step, a tie held by one rank only (both copies there, as on the V placement) is summed locally,
with no communication; a tie held by two ranks (the embedding and the head of a loop placement)
is exchanged between just those two: one batch of one send and one receive of the tie's size
(``a + b`` on both sides, the same bits as an all-reduce of two values); a tie held by more
ranks is all-reduced over the pipeline group, the other ranks adding zeros. No process group is
created (a group made with ``use_local_synchronization`` is named after its ranks only, so two
groups of the same ranks would share their store prefix).

See Also:
    :pt:`torch.distributed.batch_isend_irecv`
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from hp_pp.stage import PipelineStage

_ROW = 3  # name hash, numel, dtype hash
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class TiedGradients:
    """Which ranks hold each tied parameter, and the per-step sum of their gradients.

    Args:
        stages: This rank's stages.
        group: The pipeline process group (``None``: the world).

    Raises:
        ValueError: two ranks declare the same tie with different sizes or dtypes.

    Attributes:
        holders: ``{tie: pipeline-group ranks holding it}`` (every tie of the pipeline).
        collectives: Exchanges or all-reduces this rank issued so far in :meth:`reduce`.
        bytes_reduced: Bytes this rank sent (or all-reduced) for them.
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
        self.holders: dict[str, tuple[int, ...]] = {}
        # name hash -> (holders, (numel, dtype hash), local name or None)
        self._ties: dict[int, tuple[tuple[int, ...], tuple[int, int], str | None]] = {}
        self._discover()

    def _discover(self) -> None:
        device = self.stages[0].device
        size = dist.get_world_size(self.group)
        ties = sorted(self.local)
        count = torch.tensor([len(ties)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=self.group)
        sizes = torch.cat(counts).tolist()  # one host read, once at set-up
        if max(sizes) == 0:
            return
        # one row per tie (name hash, elements, dtype hash), padded to the longest rank's table;
        # built on the host and copied once (not one device write per element)
        local_rows = [
            [_hash(t), self.local[t][0].numel(), _hash(str(self.local[t][0].dtype))] for t in ties
        ]
        local_rows += [[0] * _ROW for _ in range(max(sizes) - len(ties))]
        rows = torch.tensor(local_rows, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(gathered, rows, group=self.group)
        table = torch.stack(gathered).tolist()  # one host read
        by_rank = [{row[0]: (row[1], row[2]) for row in table[r][: sizes[r]]} for r in range(size)]
        me = dist.get_rank(self.group)
        # Ties this rank does not hold but that span more than two ranks: it adds zeros there.
        everywhere = {key for entry in by_rank for key in entry}
        for key in sorted(everywhere):
            holders = tuple(r for r in range(size) if key in by_rank[r])
            shapes = {by_rank[r][key] for r in holders}
            if len(shapes) != 1:
                raise ValueError(
                    f"a tied parameter is declared with different sizes or dtypes on pipeline "
                    f"ranks {list(holders)}: {sorted(shapes)} (elements, dtype hash); tied "
                    "parameters must have one shape and dtype"
                )
            name = next((t for t in ties if _hash(t) == key), None)
            self.holders[name or f"#{key}"] = holders
            self._ties[key] = (holders, shapes.pop(), name)
        self._me = me

    def reduce(self) -> None:
        """Give every copy of each tie the sum of the tie's gradients over all its copies."""
        for key in sorted(self._ties):
            holders, (numel, dtype_hash), name = self._ties[key]
            params = self.local.get(name, []) if name is not None else []
            if not params and len(holders) <= 2:
                continue  # a tie between other ranks
            if params:
                grads = [p.grad for p in params if p.grad is not None]
                total = torch.zeros_like(params[0]) if not grads else grads[0].clone()
                for g in grads[1:]:
                    total += g
            else:  # a tie of three or more ranks, not held here: add zeros
                dtype = next((d for d in _DTYPES if _hash(str(d)) == dtype_hash), torch.float32)
                total = torch.zeros(numel, dtype=dtype, device=self.stages[0].device)
            if len(holders) == 2:
                peer_rank = holders[1] if holders[0] == self._me else holders[0]
                peer = (
                    peer_rank if self.group is None else dist.get_global_rank(self.group, peer_rank)
                )
                theirs = torch.empty_like(total)
                ops = [
                    dist.P2POp(_c10d.isend, total, peer, self.group),
                    dist.P2POp(_c10d.irecv, theirs, peer, self.group),
                ]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                # Lower rank's gradient first on both sides: the same bits everywhere.
                total = total + theirs if self._me < peer_rank else theirs + total
                self.collectives += 1
                self.bytes_reduced += total.numel() * total.element_size()
            elif len(holders) > 2:
                dist.all_reduce(total, group=self.group)
                self.collectives += 1
                self.bytes_reduced += total.numel() * total.element_size()
            for p in params:
                p.grad = total.clone() if len(params) > 1 else total
