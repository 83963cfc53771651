"""Fault tolerance through torchft: replica groups, live recovery, LocalSGD / DiLoCo."""

from hp_trainer.components.ft.data import replica_batches, replica_sample_indices
from hp_trainer.components.ft.lighthouse import run_lighthouse
from hp_trainer.components.ft.manager import (
    FTManager,
    check_fault_tolerance_layout,
    config_fingerprint,
)

__all__ = [
    "FTManager",
    "check_fault_tolerance_layout",
    "config_fingerprint",
    "replica_batches",
    "replica_sample_indices",
    "run_lighthouse",
]
