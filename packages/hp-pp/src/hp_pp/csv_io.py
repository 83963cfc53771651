"""Schedule tables as CSV: one row per rank, one cell per action, a blank cell for idle.

Cells use the compact notation of :class:`hp_pp.actions.Action` (``0F1``, ``1B0``, ``2W3``,
``0SEND_F1``, ``(0F1;1B0)OVERLAP_F_B``), the format PyTorch's pipelining reads and writes, so
a custom schedule is a file. Row ``r`` is rank ``r``; there is no header.

See Also:
    :pt:`torch.distributed.pipelining.schedules.PipelineScheduleMulti._load_csv`
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import IO

from hp_pp.actions import Action, ScheduleTable

__all__ = ["read_csv", "write_csv"]


def write_csv(table: ScheduleTable, path_or_file: str | Path | IO[str]) -> None:
    """Write ``table`` as CSV (row ``r`` = rank ``r``; ``None`` becomes a blank cell).

    Raises:
        ValueError: the ranks are not ``0 .. len(table) - 1``.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime._dump_csv`
    """
    if sorted(table) != list(range(len(table))):
        raise ValueError(f"table ranks must be 0..{len(table) - 1}, got {sorted(table)}")
    if isinstance(path_or_file, (str, Path)):
        with open(path_or_file, "w", newline="", encoding="utf-8") as handle:
            _write_rows(table, handle)
    else:
        _write_rows(table, path_or_file)


def _write_rows(table: ScheduleTable, handle: IO[str]) -> None:
    writer = csv.writer(handle, lineterminator="\n")
    for rank in range(len(table)):
        writer.writerow(["" if action is None else str(action) for action in table[rank]])


def read_csv(path_or_file: str | Path | IO[str]) -> ScheduleTable:
    """Read a table written by :func:`hp_pp.write_schedule_csv` (or by PyTorch's ``_dump_csv``).

    Raises:
        ValueError: a cell is not an action in the compact notation; the message names the
            row (rank) and column.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.PipelineScheduleMulti._load_csv`
    """
    if isinstance(path_or_file, (str, Path)):
        with open(path_or_file, newline="", encoding="utf-8") as handle:
            text = handle.read()
    else:
        text = path_or_file.read()
    table: ScheduleTable = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        actions: list[Action | None] = []
        for column, cell in enumerate(row):
            if not cell.strip():
                actions.append(None)
                continue
            try:
                actions.append(Action.parse(cell))
            except ValueError as error:
                raise ValueError(
                    f"rank {rank} (row {rank + 1}), column {column + 1}: {error}"
                ) from None
        table[rank] = actions
    return table
