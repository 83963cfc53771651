"""Public names of the planning side: actions, schedule generators, CSV, validator, simulator."""

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.comm_lowering import add_communication, add_reduce_grad, add_unshard_reshard
from hp_pp.csv_io import read_csv as read_schedule_csv
from hp_pp.csv_io import write_csv as write_schedule_csv
from hp_pp.generators import (
    SCHEDULE_NAMES,
    canonical_schedule_name,
    rank_to_stages,
    stage_to_rank,
)
from hp_pp.generators import STYLE as SCHEDULE_STYLE
from hp_pp.generators import generate as generate_schedule
from hp_pp.simulate import (
    PipelineCosts,
    SimulationResult,
    StageCosts,
    TimedAction,
    simulate_schedule,
)
from hp_pp.timeline import write_chrome_trace, write_timeline_png
from hp_pp.validate import ValidationReport, check_schedule, validate_schedule

__all__ = [
    "SCHEDULE_NAMES",
    "SCHEDULE_STYLE",
    "Action",
    "ActionType",
    "PipelineCosts",
    "ScheduleTable",
    "SimulationResult",
    "StageCosts",
    "TimedAction",
    "ValidationReport",
    "add_communication",
    "add_reduce_grad",
    "add_unshard_reshard",
    "canonical_schedule_name",
    "check_schedule",
    "generate_schedule",
    "rank_to_stages",
    "read_schedule_csv",
    "simulate_schedule",
    "stage_to_rank",
    "validate_schedule",
    "write_chrome_trace",
    "write_schedule_csv",
    "write_timeline_png",
]
