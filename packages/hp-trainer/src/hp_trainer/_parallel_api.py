"""The parallel engines hp-trainer drives: hyper-parallel's FSDP and TP (one place to import them).

Every module of hp-trainer takes ``fully_shard``, the FSDP policies and the TP styles from here,
so the engines are swapped in exactly one file.
"""

from __future__ import annotations

try:
    from torch.distributed.fsdp import (  # DEV ONLY
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )
except ImportError:  # TEMPORARY FALLBACK while hp_fsdp's runtime is not there: torch's FSDP2
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )
try:
    from torch.distributed.tensor.parallel import (  # DEV ONLY
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
except ImportError:  # TEMPORARY FALLBACK while hp_tp is not there: torch's TP (same API)
    from torch.distributed.tensor.parallel import (
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
