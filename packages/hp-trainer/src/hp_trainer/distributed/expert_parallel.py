"""Expert parallelism for the MoE decoders and their recipe: EP -> AC -> compile -> FSDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# the expert styles are torch ParallelStyles: torch's entry point applies them as they are
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import ExpertParallel, ExpertTensorParallel, TensorParallel
from hp_trainer.distributed.activation_checkpoint import apply_ac
from hp_trainer.distributed.compile import apply_compile
from hp_trainer.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.parallel_dims import ParallelDims

__all__ = ["apply_moe_ep_tp", "parallelize_moe_decoder"]


def apply_moe_ep_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None,
    ep_etp_mesh: DeviceMesh | None = None,
    etp_enabled: bool = False,
) -> None:
    """Shard the routed experts of every MoE block: EP, EP x TP, or TP alone.

    ``ep_mesh`` only: :class:`hp_cp_ep.ExpertParallel` (experts over ``ep``, tokens dispatched
    by all-to-all). ``ep_etp_mesh`` with ``etp_enabled``: :class:`hp_cp_ep.ExpertTensorParallel`
    on the 2-D ``[ep, tp]`` mesh. ``tp_mesh`` only: :class:`hp_cp_ep.TensorParallel` (every rank
    holds all experts, a slice of their hidden units).

    Args:
        model: A decoder whose blocks have ``moe_enabled`` and ``moe.experts``.
        tp_mesh: Tensor-parallel mesh (None: no TP).
        ep_mesh: Expert-parallel mesh (None: no EP).
        ep_etp_mesh: The 2-D ``[ep, tp]`` mesh for expert tensor parallelism.
        etp_enabled: Shard each expert's hidden units over TP too.

    Raises:
        ValueError: ``etp_enabled`` without ``ep_etp_mesh``; the styles' own errors (experts not
            divisible by the EP degree, hidden size by the TP degree).

    See Also:
        ``torchtitan.distributed.expert_parallel`` and
        ``torchtitan.models.deepseek_v3.infra.parallelize.apply_moe_ep_tp``.
    """
    if etp_enabled and ep_etp_mesh is None:
        raise ValueError("etp_enabled=True needs the 2-D [ep, tp] mesh ep_etp_mesh")
    layers = model.get_submodule("layers")
    for block in layers.children():
        if not getattr(block, "moe_enabled", False):
            continue
        experts = block.get_submodule("moe.experts")
        if ep_mesh is not None and etp_enabled:
            assert ep_etp_mesh is not None
            parallelize_module(experts, ep_etp_mesh, ExpertTensorParallel())
        elif ep_mesh is not None:
            parallelize_module(experts, ep_mesh, ExpertParallel())
        elif tp_mesh is not None:
            parallelize_module(experts, tp_mesh, TensorParallel())


def parallelize_moe_decoder(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply EP, activation checkpointing, compile and FSDP (experts on ``efsdp``) to a decoder.

    Experts are sharded over ``ep`` first; FSDP then shards every block over the data-parallel
    mesh and the experts, as a second parameter group of the block's unit, over the
    expert-data-parallel mesh ``efsdp`` (``dp_shard * cp // ep`` ranks holding the same experts).
    FSDP's gradient division is off: the trainer divides the loss by the global token count.

    Args:
        model: A :class:`~hp_trainer.models._moe_block.MoEDecoder`.
        parallel_dims: Degrees and meshes (``build_mesh`` done when world size > 1).
        job_config: The job configuration.

    Returns:
        The model, parallelized in place.

    Raises:
        ValueError: With tensor parallelism (not available for the MoE families in this
            release: use expert and data parallelism), or context/pipeline parallelism.

    See Also:
        ``torchtitan.models.deepseek_v3.infra.parallelize.parallelize_deepseekv3`` and
        ``torchtitan.models.qwen3.infra.parallelize.parallelize_qwen3``.
    """
    dims = parallel_dims
    for name, degree in (("tensor", dims.tp), ("context", dims.cp), ("pipeline", dims.pp)):
        if degree > 1:
            raise ValueError(
                f"parallelism.{name}_parallel_degree = {degree}: the MoE models (qwen3_moe, "
                "deepseek_v3) train with expert and data parallelism (FSDP/HSDP) in this "
                f"release; use {name}_parallel_degree = 1"
            )
    par = job_config.parallelism
    if dims.ep_enabled:
        apply_moe_ep_tp(model, None, dims.get_mesh("ep"))
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable:
        apply_compile(model, job_config.compile)
    if dims.dp_enabled:
        from hp_trainer.models._common import _DTYPES

        training = job_config.training
        apply_fsdp_to_decoder(
            model,
            dims.get_mesh("fsdp_mesh"),
            param_dtype=_DTYPES[training.mixed_precision_param],
            reduce_dtype=_DTYPES[training.mixed_precision_reduce],
            pp_enabled=dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward_policy=par.fsdp_reshard_after_forward,
            ep_degree=dims.ep,
            edp_mesh=dims.get_mesh("efsdp") if dims.ep_enabled else None,
            enable_symm_mem=par.enable_symm_mem,
        )
        disable_fsdp_gradient_division(model)
    return model
