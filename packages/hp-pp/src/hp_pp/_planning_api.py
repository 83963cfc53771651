"""Public names of the planning side: actions, schedule generators, CSV, validator, simulator."""

from hp_pp.actions import Action, ActionType, ScheduleTable

__all__ = ["Action", "ActionType", "ScheduleTable"]
