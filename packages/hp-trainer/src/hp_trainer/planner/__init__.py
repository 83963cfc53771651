"""The auto-parallel planner (HyperParallel's SAPP, with checked predictions) and ``hp-plan``.

:func:`plan_layouts` enumerates every layout of a model on a world size through the trainer's
own layout validation, prunes the search symbolically, estimates each survivor with the cost
model (:func:`estimate_layout`: FLOPs, alpha-beta collectives per link, hp-pp's simulator for
pipeline bubbles, memory per rank) against a :class:`DeviceProfile`, and ranks them.
``hp-plan`` prints the table and writes the best as a config overlay; ``hp-train
--parallelism.auto true`` applies it at start-up.
"""

from hp_trainer.planner.calibrate import calibrate_device_profile
from hp_trainer.planner.cost import LayoutCandidate, LayoutEstimate, estimate_layout
from hp_trainer.planner.model_stats import ModelStats, model_stats
from hp_trainer.planner.overlay import layout_overlay, write_overlay
from hp_trainer.planner.profiles import (
    DeviceProfile,
    available_device_profiles,
    load_device_profile,
)
from hp_trainer.planner.search import PlanResult, RejectedLayout, plan_layouts

__all__ = [
    "DeviceProfile",
    "LayoutCandidate",
    "LayoutEstimate",
    "ModelStats",
    "PlanResult",
    "RejectedLayout",
    "available_device_profiles",
    "calibrate_device_profile",
    "estimate_layout",
    "layout_overlay",
    "load_device_profile",
    "model_stats",
    "plan_layouts",
    "write_overlay",
]
