"""The tensor-level step measurement the planner's memory model is checked against.

``hp_trainer.planner._measure`` replays the profiler's allocator events by address, in time
order: a block counts from its allocation on the calling thread to its free. Here the exact
answer is known from the allocations themselves, including a case where per-operator memory
totals (``self_cpu_memory_usage``, which land at the operator's start) read 5 MiB for an 8 MiB
peak.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from hp_trainer.planner._measure import profile_peak

_MIB = 2**20


def _blocks(n: int) -> torch.Tensor:
    return torch.empty(n * _MIB, dtype=torch.uint8)


def test_peak_replays_blocks_in_time_order() -> None:
    before = _blocks(3)  # alive at the start: not part of the peak above it

    def region() -> None:
        with record_function("scope"):  # its frees come at its end, its allocations inside
            a = _blocks(4)
            b = _blocks(4)  # 8: the peak
            del a, b
        c = _blocks(2)
        d = _blocks(3)  # 5
        del c
        e = _blocks(1)  # 4
        del d, e

    where = profile_peak(region)
    assert where.peak == 8 * _MIB
    assert where.live == {"scope > aten::empty": 8 * _MIB}
    assert where.at[-1] == "aten::empty"
    del before


def test_peak_counts_blocks_freed_by_another_operator() -> None:
    kept: list[torch.Tensor] = []

    def region() -> None:
        kept.append(_blocks(2))
        x = _blocks(1)
        y = x + x  # 1 + 1 + 2 kept = 4: the peak
        del x, y
        kept.clear()  # the free of the kept block, outside any operator
        z = _blocks(3)  # 3 < 4
        del z

    # (besides a few bytes of scalars)
    assert 4 * _MIB <= profile_peak(region).peak < 4 * _MIB + 1024
