"""CSV tables: exact round trips, PyTorch's reader agrees, bad cells named by rank and column."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from hp_pp.comm_lowering import add_communication, add_reduce_grad, add_unshard_reshard
from hp_pp.csv_io import read_csv, write_csv
from hp_pp.generators import SCHEDULE_NAMES, STYLE, generate

_SIZES = {"ZBVZeroBubble": (2, 4, 5), "DualPipeV": (3, 6, 7)}


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_round_trip_reproduces_table_exactly(name: str, tmp_path: Path) -> None:
    p, n, m = _SIZES.get(name, (3, 6, 6) if name not in ("GPipe", "1F1B") else (3, 3, 5))
    compute = generate(name, pp_size=p, num_stages=n, n_microbatches=m)
    lowered = add_communication(compute, num_stages=n, style=STYLE[name])
    with_fsdp = add_unshard_reshard(add_reduce_grad(lowered, n_microbatches=m))
    for table in (compute, lowered, with_fsdp):
        path = tmp_path / "schedule.csv"
        write_csv(table, path)
        assert read_csv(path) == table
        buffer = io.StringIO()
        write_csv(table, buffer)
        assert read_csv(io.StringIO(buffer.getvalue())) == table


def test_torch_reads_our_file_and_we_read_its(tmp_path: Path) -> None:
    table = generate("DualPipeV", pp_size=2, num_stages=4, n_microbatches=4)
    path = tmp_path / "dualpipev.csv"
    write_csv(table, path)
    rows = path.read_text().splitlines()
    # torch's parser (the same one its _load_csv uses) reads every cell to the same action.
    for rank, row in enumerate(rows):
        cells = row.split(",")
        for cell, ours in zip(cells, table[rank], strict=True):
            theirs = torch_schedules._Action.from_str(cell)
            assert (theirs is None) == (ours is None)
            if ours is not None:
                assert repr(theirs) == str(ours)
    torch_written = tmp_path / "torch.csv"
    with open(torch_written, "w", newline="") as handle:
        writer = csv.writer(handle)
        for rank in sorted(table):
            writer.writerow(
                [
                    None if a is None else torch_schedules._Action.from_str(str(a))
                    for a in table[rank]
                ]
            )
    assert read_csv(torch_written) == table


def test_idle_cells_and_empty_rows_survive() -> None:
    table = generate("GPipe", pp_size=3, num_stages=3, n_microbatches=2)
    table[0] = [None, *table[0], None, None]
    buffer = io.StringIO()
    write_csv(table, buffer)
    assert buffer.getvalue().splitlines()[0].startswith(",0F0,0F1")
    assert read_csv(io.StringIO(buffer.getvalue())) == table


def test_bad_cell_names_rank_and_column() -> None:
    with pytest.raises(ValueError, match=r"rank 1 \(row 2\), column 3: '1X0' is not an action"):
        read_csv(io.StringIO("0F0,0B0\n1F0,,1X0\n"))


def test_ranks_must_be_contiguous() -> None:
    table = generate("GPipe", pp_size=2, num_stages=2, n_microbatches=1)
    with pytest.raises(ValueError, match=r"ranks must be 0\.\.1, got \[0, 2\]"):
        write_csv({0: table[0], 2: table[1]}, io.StringIO())
