"""The per-unit settings the ``FSDPModule`` setters change (one frozen object per unit).

See Also:
    :pt:`torch.distributed.fsdp.FSDPModule`: the setters that fill it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_kernels import AllGather, ReduceScatter

__all__ = ["GroupOptions"]


@dataclass(frozen=True)
class GroupOptions:
    """The per-unit settings of a :class:`ParamGroup` (one immutable object, replaced whole).

    ``FSDPModule``'s setters and ``fully_shard``'s keywords change them through
    :meth:`ParamGroup.configure`; the runtime only reads them.

    Attributes:
        reduce_grads: reduce gradients in backward (``set_requires_gradient_sync``).
        all_reduce_grads: HSDP replicate-axis all-reduce (``set_requires_all_reduce``).
        reshard_after_backward: free the unsharded parameters after backward.
        unshard_async_op: PyTorch's ``unshard_async_op`` (collectives are async anyway).
        unshard_in_backward: all-gather again in backward (``set_unshard_in_backward``).
        gradient_divide_factor: divide reduced gradients by this (None: the DP size).
        force_sum_reduction: reduce with ``SUM`` only and divide locally.
        reduce_op_type: ``"avg"`` or ``"sum"`` (HyperParallel's extension).
        gradient_scaling_factor: multiply reduced gradients by this (extension).
        custom_all_gather: the all-gather implementation (None: the default).
        custom_reduce_scatter: the reduce-scatter implementation (None: the default).
        all_reduce_hook: called on each reduced shard before it is written.
        reduce_scatter_unused_params: reduce zeros for unused trainable parameters.
        max_inflight_reductions: reductions left in flight when a unit issues its own.
        reduce_scatter_group: a separate process group for reduce-scatters.
        comm_fusion: one fused collective per unit (False: one per parameter).
        comm_fusion_zero_copy: keep the shards in one flat all-gather input.
        sharded_accumulated_grad: reduce every micro-batch and accumulate sharded gradients.

    See Also:
        :pt:`torch.distributed.fsdp.FSDPModule`: the setters that fill it.
    """

    reduce_grads: bool = True
    all_reduce_grads: bool = True
    reshard_after_backward: bool = True
    unshard_async_op: bool = False
    unshard_in_backward: bool = True
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False
    reduce_op_type: str = "avg"
    gradient_scaling_factor: float | torch.Tensor | None = None
    custom_all_gather: AllGather | None = None
    custom_reduce_scatter: ReduceScatter | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    reduce_scatter_unused_params: bool = False
    max_inflight_reductions: int = 1
    reduce_scatter_group: dist.ProcessGroup | None = None
    comm_fusion: bool = True
    comm_fusion_zero_copy: bool = False
    sharded_accumulated_grad: bool = False
