"""The parallel engines hp-trainer drives: hyper-parallel's FSDP and TP (one place to import them).

Every module of hp-trainer takes ``fully_shard``, the FSDP policies and the TP styles from here,
so the engines are swapped in exactly one file.
"""

from __future__ import annotations

import hp_fsdp
from hp_tp import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

# What the trainer needs from the FSDP engine beyond fully_shard itself.
_FSDP_NEEDS = ("set_gradient_divide_factor",)

if all(hasattr(hp_fsdp.FSDPModule, name) for name in _FSDP_NEEDS):
    from hp_fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
else:  # pragma: no cover
    # TEMPORARY FALLBACK (remove when hp_fsdp's runtime lands): hp_fsdp 0.1 does not yet offer
    # set_gradient_divide_factor nor FSDP over DTensor (TP) parameters, so the trainer drives
    # torch's FSDP2, whose API hp_fsdp mirrors name for name.
    from torch.distributed.fsdp import (  # type: ignore[assignment,no-redef]
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

__all__ = [
    "CPUOffloadPolicy",
    "ColwiseParallel",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ParallelStyle",
    "PrepareModuleInput",
    "RowwiseParallel",
    "SequenceParallel",
    "fully_shard",
    "loss_parallel",
    "parallelize_module",
]
