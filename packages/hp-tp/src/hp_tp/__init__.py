"""Tensor parallelism on torch's DTensor: parallel styles, ``parallelize_module``,
``loss_parallel``, and HyperParallel's declarative ``shard_module`` / ``DFunction``.

The styles and ``parallelize_module`` have the names, signatures and defaults of
``torch.distributed.tensor.parallel``; migrating is an import change. The implementation is our
own, built on DTensor (``distribute_tensor``, ``DTensor.from_local``, ``redistribute``), so the
parameters are torch DTensors and compose with ``hp_fsdp.fully_shard`` and torch's own tools.

See Also:
    :pt:`torch.distributed.tensor.parallel`: PyTorch's tensor-parallel API.
"""

from hp_tp.__about__ import __version__
from hp_tp.dfunction import DFunction
from hp_tp.loss import loss_parallel
from hp_tp.parallelize import parallelize_module
from hp_tp.shard import ShardingPlan, shard_module
from hp_tp.style import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "DFunction",
    "NoParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "ShardingPlan",
    "__version__",
    "loss_parallel",
    "parallelize_module",
    "shard_module",
]
