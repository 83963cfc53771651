"""The ``hp-pp`` command: compare schedules in the simulator, validate a schedule file.

``hp-pp simulate --schedule ZBV --stages 4 --microbatches 8 [--ranks R] [--costs FILE.toml]
[--out DIR]`` simulates the chosen schedule and, on the same ranks and the same model (stage
costs re-cut evenly when a schedule uses a different number of stages), every other built-in,
prints a comparison table and writes a timeline PNG and a Chrome trace per schedule to
``DIR``. ``hp-pp validate FILE.csv [--costs FILE.toml] [--out DIR]`` checks a schedule file
offline, simulates it and, with ``--out``, draws it. Bad input prints a clear
error and exits with 2; an invalid schedule exits with 1.

See Also:
    :pt:`torch.distributed.pipelining.schedules._dump_chrometrace`
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hp_pp.actions import ScheduleTable
from hp_pp.csv_io import read_csv
from hp_pp.generators import SCHEDULE_NAMES, STYLE, canonical_schedule_name, generate
from hp_pp.simulate import PipelineCosts, SimulationResult, simulate_schedule
from hp_pp.validate import validate_schedule

__all__ = ["main"]

_USAGE_ERROR = 2
_INVALID_SCHEDULE = 1


def _natural_stages(name: str, ranks: int) -> int:
    """Stages a schedule runs on ``ranks`` ranks when it is not the chosen one."""
    if name in ("GPipe", "1F1B"):
        return ranks
    return 2 * ranks


def _default_ranks(name: str, stages: int) -> int:
    if name in ("GPipe", "1F1B"):
        return stages
    if STYLE[name] == "v" or stages % 2 == 0:
        return max(1, stages // 2)
    return stages


@dataclass(frozen=True)
class _Row:
    name: str
    stages: int
    ranks: int
    result: SimulationResult | None
    reason: str = ""


def _simulate_one(
    name: str, ranks: int, stages: int, microbatches: int, costs: PipelineCosts
) -> tuple[ScheduleTable, SimulationResult]:
    table = generate(name, pp_size=ranks, num_stages=stages, n_microbatches=microbatches)
    return table, simulate_schedule(table, costs)


def _cmd_simulate(args: argparse.Namespace, out: TextIO) -> int:
    chosen = canonical_schedule_name(args.schedule)
    stages = args.stages
    ranks = args.ranks if args.ranks is not None else _default_ranks(chosen, stages)
    costs = PipelineCosts.from_toml(args.costs) if args.costs else PipelineCosts()
    rows: list[_Row] = []
    _, chosen_result = _simulate_one(chosen, ranks, stages, args.microbatches, costs)
    names = [chosen] + ([n for n in SCHEDULE_NAMES if n != chosen] if args.compare else [])
    for name in names:
        n_stages = stages if name == chosen else _natural_stages(name, ranks)
        try:
            recut = costs if n_stages == stages else costs.split_evenly(n_stages, stages)
            _, result = _simulate_one(name, ranks, n_stages, args.microbatches, recut)
        except ValueError as error:
            rows.append(_Row(name, n_stages, ranks, None, str(error)))
            continue
        rows.append(_Row(name, n_stages, ranks, result))
    _print_table(rows, chosen, chosen_result, args.microbatches, out)
    if args.out is not None:
        _write_pictures(rows, Path(args.out), args.png, out)
    return 0


def _print_table(
    rows: list[_Row], chosen: str, reference: SimulationResult, microbatches: int, out: TextIO
) -> None:
    print(f"{microbatches} micro-batches; step time relative to {chosen} (*)", file=out)
    columns = ("stages", 6), ("ranks", 5), ("step", 9), ("bubble", 7), ("peak act", 8), ("vs *", 6)
    print(f"  {'schedule':<22} " + " ".join(f"{n:>{w}}" for n, w in columns), file=out)
    for row in rows:
        mark = "*" if row.name == chosen else " "
        if row.result is None:
            print(
                f"{mark} {row.name:<22} {row.stages:>6} {row.ranks:>5}   n/a: {row.reason}",
                file=out,
            )
            continue
        r = row.result
        peak = max(r.peak_activation_memory.values(), default=0.0)
        ratio = r.step_time / reference.step_time if reference.step_time else float("nan")
        print(
            f"{mark} {row.name:<22} {row.stages:>6} {row.ranks:>5} {r.step_time:>9.3f} "
            f"{r.bubble_fraction:>7.1%} {peak:>8.2f} {ratio:>6.3f}",
            file=out,
        )


def _write_pictures(rows: list[_Row], directory: Path, png: bool, out: TextIO) -> None:
    from hp_pp.timeline import write_chrome_trace, write_timeline_png

    directory.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if row.result is None:
            continue
        write_chrome_trace(row.result, directory / f"{row.name}.trace.json", name=row.name)
        if png:
            title = f"{row.name}, {row.stages} stages on {row.ranks} ranks"
            write_timeline_png(row.result, directory / f"{row.name}.png", title=title)
    kinds = "timeline PNGs and Chrome traces" if png else "Chrome traces"
    print(f"wrote {kinds} to {directory}", file=out)


def _cmd_validate(args: argparse.Namespace, out: TextIO) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    table = read_csv(path)
    if not table:
        raise ValueError(f"{path}: the file holds no rows (one row per rank expected)")
    report = validate_schedule(
        table, num_stages=args.stages, n_microbatches=args.microbatches, style=args.style
    )
    print(
        f"{path}: {report.pp_size} ranks, {report.num_stages} stages, "
        f"{report.n_microbatches} micro-batches",
        file=out,
    )
    if not report.ok:
        print(f"INVALID ({len(report.problems)} problems):", file=out)
        for problem in report.problems:
            print(f"  {problem}", file=out)
        return _INVALID_SCHEDULE
    costs = PipelineCosts.from_toml(args.costs) if args.costs else PipelineCosts()
    result = simulate_schedule(table, costs)
    print("OK: no deadlock, every transfer matched, all work present and in order", file=out)
    print(f"  peak in-flight activations per rank: {report.peak_in_flight}", file=out)
    what = "simulation" if args.costs else "unit-cost simulation"
    print(f"  {what}: step {result.step_time:g}, bubble {result.bubble_fraction:.1%}", file=out)
    if args.out is not None:
        row = _Row(path.stem, report.num_stages, report.pp_size, result)
        _write_pictures([row], Path(args.out), args.png, out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-pp", description="Pipeline schedules: simulate and compare, validate files."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="simulate a schedule and compare it with the others")
    sim.add_argument(
        "--schedule", required=True, help=f"one of {', '.join(SCHEDULE_NAMES)} (or ZBV)"
    )
    sim.add_argument("--stages", type=int, required=True, help="stages of the chosen schedule")
    sim.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    sim.add_argument(
        "--ranks", type=int, default=None, help="pipeline ranks (default: from the schedule)"
    )
    sim.add_argument("--costs", default=None, help="TOML file of stage and transfer costs")
    sim.add_argument("--out", default=None, help="directory for timeline PNGs and Chrome traces")
    sim.add_argument(
        "--no-compare", dest="compare", action="store_false", help="only the chosen schedule"
    )
    sim.add_argument("--no-png", dest="png", action="store_false", help="Chrome traces only")
    val = commands.add_parser("validate", help="check a schedule CSV file offline")
    val.add_argument("file", help="CSV file: one row per rank, compact notation, blank = idle")
    val.add_argument("--stages", type=int, default=None, help="expected number of stages")
    val.add_argument("--microbatches", type=int, default=None, help="expected micro-batches")
    val.add_argument(
        "--style", choices=("loop", "v"), default=None, help="expected stage placement"
    )
    val.add_argument("--costs", default=None, help="TOML file of stage and transfer costs")
    val.add_argument("--out", default=None, help="directory for its timeline PNG and Chrome trace")
    val.add_argument("--no-png", dest="png", action="store_false", help="Chrome trace only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hp-pp``; returns the exit code (0 fine, 1 invalid schedule, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "simulate":
            return _cmd_simulate(args, sys.stdout)
        return _cmd_validate(args, sys.stdout)
    except (ValueError, TypeError, ImportError, OSError) as error:
        print(f"hp-pp {args.command}: error: {error}", file=sys.stderr)
        return _USAGE_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
