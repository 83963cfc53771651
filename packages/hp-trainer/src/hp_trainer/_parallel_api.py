"""The parallel engines hp-trainer drives: hyper-parallel's FSDP and TP (one place to import them).

Every module of hp-trainer takes ``fully_shard``, the FSDP policies and the TP styles from here,
so the engines are swapped in exactly one file.
"""

from __future__ import annotations

from hp_fsdp import (
    CPUOffloadPolicy,
    FSDPMeshInfo,
    FSDPModule,
    HSDPMeshInfo,
    MixedPrecisionPolicy,
    ShardPlacementResult,
    fully_shard,
)
from hp_tp import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__all__ = [
    "CPUOffloadPolicy",
    "ColwiseParallel",
    "FSDPMeshInfo",
    "FSDPModule",
    "HSDPMeshInfo",
    "MixedPrecisionPolicy",
    "ParallelStyle",
    "PrepareModuleInput",
    "RowwiseParallel",
    "SequenceParallel",
    "ShardPlacementResult",
    "fully_shard",
    "loss_parallel",
    "parallelize_module",
]
