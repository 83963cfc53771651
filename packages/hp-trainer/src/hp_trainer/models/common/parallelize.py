"""The generic parallelize recipe of a dense decoder: TP/CP -> AC -> compile -> FSDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hp_trainer.distributed.activation_checkpoint import apply_ac
from hp_trainer.distributed.compile import apply_compile
from hp_trainer.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
from hp_trainer.distributed.sharding import apply_sharding
from hp_trainer.models.common.tensor_parallel import DENSE_DECODER_SHARDING, check_tp_degree
from hp_trainer.protocols.sharding import ShardingConfig

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["MIXED_PRECISION_DTYPES", "parallelize_dense_decoder"]

MIXED_PRECISION_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""``training.mixed_precision_param`` / ``_reduce`` names and their dtypes."""


def parallelize_dense_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    *,
    sharding: ShardingConfig = DENSE_DECODER_SHARDING,
) -> nn.Module:
    """Apply TP and CP, activation checkpointing, compile and FSDP/HSDP, in that order.

    The model's table (TP section when ``tp > 1``, CP section when ``cp > 1``) goes to the
    generic :func:`~hp_trainer.distributed.sharding.apply_sharding`; FSDP/HSDP (with FSDP's
    gradient division turned off, since the trainer divides the loss by the global token
    count) when any data parallelism is on.

    Args:
        model: A dense :class:`~hp_trainer.models.common.decoder.Decoder`.
        parallel_dims: Degrees and meshes (``build_mesh`` done when world size > 1).
        job_config: The job configuration.
        sharding: Keyword-only; the family's table (default
            :data:`~hp_trainer.models.common.tensor_parallel.DENSE_DECODER_SHARDING`).

    Returns:
        The model, parallelized in place.

    See Also:
        :titan:`torchtitan.models.llama3.infra.parallelize.parallelize_llama`: TorchTitan's recipe.
    """
    par = job_config.parallelism
    tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
    if tp_mesh is not None:
        check_tp_degree(model, tp_mesh, enable_async_tp=par.enable_async_tensor_parallel)
    apply_sharding(
        model,
        sharding,
        tp_mesh,
        cp_mesh=parallel_dims.get_mesh("cp") if parallel_dims.cp_enabled else None,
        loss_parallel=not par.disable_loss_parallel,
    )
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable:
        # a checkpoint cannot be traced around the context-parallel attention (a graph break)
        apply_compile(model, job_config.compile, inside_checkpoint=parallel_dims.cp_enabled)
    if parallel_dims.dp_enabled or parallel_dims.cp_enabled:
        training = job_config.training
        apply_fsdp_to_decoder(
            model,
            parallel_dims.get_mesh("fsdp_mesh"),
            param_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_param],
            reduce_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward_policy=par.fsdp_reshard_after_forward,
            ep_degree=parallel_dims.ep,
            edp_mesh=parallel_dims.get_optional_mesh("efsdp"),
            enable_symm_mem=par.enable_symm_mem,
        )
        disable_fsdp_gradient_division(model)
    return model
