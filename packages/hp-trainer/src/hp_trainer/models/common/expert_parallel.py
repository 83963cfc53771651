"""Expert parallelism for the MoE decoders and their recipe: EP -> AC -> compile -> FSDP."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp_cp_ep import ExpertParallel, ExpertTensorParallel, TensorParallel
from hp_tp import NoParallel
from hp_trainer._parallel_api import ParallelStyle
from hp_trainer.distributed.activation_checkpoint import apply_ac
from hp_trainer.distributed.compile import apply_compile
from hp_trainer.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
from hp_trainer.distributed.sharding import apply_sharding
from hp_trainer.models.common.parallelize import MIXED_PRECISION_DTYPES
from hp_trainer.models.common.tensor_parallel import (
    DENSE_FFN_RULES,
    GQA_ATTENTION_RULES,
    ROPE_CP_RULES,
    TRUNK_RULES,
    check_tp_degree,
)
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "MOE_DECODER_SHARDING",
    "MOE_EXPERT_RULES",
    "MOE_RULES",
    "ReplicateTokensForMoE",
    "apply_moe_ep_tp",
    "apply_tp_to_moe_decoder",
    "expert_style",
    "moe_layout_error",
    "parallelize_moe_decoder",
]


def expert_style(options: Mapping[str, Any]) -> Any:
    """The routed experts' style for the layout in ``options`` (the ``ep`` rules' factory).

    ``expert_layout`` ``"ep"``: :class:`hp_cp_ep.ExpertParallel` (experts over the 1-D EP
    mesh, tokens dispatched by all-to-all); ``"ep_tp"``: :class:`hp_cp_ep.ExpertTensorParallel`
    on the 2-D ``[ep, tp]`` mesh; ``"tp"``: :class:`hp_cp_ep.TensorParallel` (every rank holds
    all experts, a slice of their hidden units; no dispatch). The two dispatching styles get
    ``options["dispatcher"]`` as keyword arguments.

    Args:
        options: The applier's options (``expert_layout``, ``dispatcher``).

    Returns:
        A fresh style (PyTorch's style protocol, applied as it is by hp-tp's entry point).

    Raises:
        ValueError: Dispatcher options with the ``"tp"`` layout (no dispatch).

    See Also:
        :titan:`torchtitan.distributed.expert_parallel`: TorchTitan's expert styles, chosen
        in its parallelize code.
    """
    layout = options["expert_layout"]
    dispatcher = dict(options.get("dispatcher") or {})
    if layout == "tp":
        if dispatcher:
            raise ValueError(
                f"dispatcher options {sorted(dispatcher)} need expert parallelism; the experts "
                "are tensor parallel only (expert_parallel_degree = 1)"
            )
        return TensorParallel()
    style = ExpertTensorParallel if layout == "ep_tp" else ExpertParallel
    return style(**dispatcher)


MOE_EXPERT_RULES = (ShardingRule("layers.*.moe.experts", expert_style),)
"""The routed experts of every MoE block, over the expert mesh (:func:`expert_style`)."""


def apply_moe_ep_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None,
    ep_etp_mesh: DeviceMesh | None = None,
    etp_enabled: bool = False,
    *,
    sharding: ShardingConfig | None = None,
    dispatcher: Mapping[str, Any] | None = None,
) -> None:
    """Shard the routed experts of every MoE block: EP, EP x TP, or TP alone.

    ``ep_mesh`` only: :class:`hp_cp_ep.ExpertParallel` (experts over ``ep``, tokens dispatched
    by all-to-all). ``ep_etp_mesh`` with ``etp_enabled``: :class:`hp_cp_ep.ExpertTensorParallel`
    on the 2-D ``[ep, tp]`` mesh. ``tp_mesh`` only: :class:`hp_cp_ep.TensorParallel` (every rank
    holds all experts, a slice of their hidden units). The styles come from the ``ep`` section
    of the table, applied by :func:`~hp_trainer.distributed.sharding.apply_sharding`.

    Args:
        model: A decoder whose MoE blocks have ``moe.experts``.
        tp_mesh: Tensor-parallel mesh (None: no TP).
        ep_mesh: Expert-parallel mesh (None: no EP).
        ep_etp_mesh: The 2-D ``[ep, tp]`` mesh for expert tensor parallelism.
        etp_enabled: Shard each expert's hidden units over TP too.
        sharding: Keyword-only; the table whose ``ep`` section is applied (default
            :data:`MOE_DECODER_SHARDING`).
        dispatcher: Keyword-only; options of the expert dispatcher (over the table's).

    Raises:
        ValueError: ``etp_enabled`` without ``ep_etp_mesh``; the styles' own errors (experts not
            divisible by the EP degree, hidden size by the TP degree).

    See Also:
        :titan:`torchtitan.distributed.expert_parallel` and
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.apply_moe_ep_tp`.
    """
    if etp_enabled and ep_etp_mesh is None:
        raise ValueError("etp_enabled=True needs the 2-D [ep, tp] mesh ep_etp_mesh")
    if ep_mesh is not None:
        mesh, layout = (ep_etp_mesh, "ep_tp") if etp_enabled else (ep_mesh, "ep")
    else:
        mesh, layout = tp_mesh, "tp"
    apply_sharding(
        model,
        MOE_DECODER_SHARDING if sharding is None else sharding,
        None,
        expert_mesh=mesh,
        expert_layout=layout,
        dispatcher=dispatcher,
    )


def _replicate_tokens_for_moe(moe: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run ``moe`` on all tokens of the sequence on every TP rank; shard its output again.

    The sequence-sharded input is all-gathered (backward: each rank keeps its chunk of the
    replicated gradient), the MoE computes on plain tensors, and its replicated output is
    sharded on the sequence and returned as the local chunk (backward: all-gather), so the
    router's and shared experts' gradients are the full ones on every TP rank.
    """

    def gather(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
        return (x.redistribute(tp_mesh, [Replicate()]).to_local(), *args[1:])

    def shard(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        # the residual stream between blocks is the local sequence chunk (as the dense plan's)
        return full.redistribute(tp_mesh, [Shard(1)]).to_local()

    moe.register_forward_pre_hook(gather)
    moe.register_forward_hook(shard)


class ReplicateTokensForMoE(ParallelStyle):
    """The MoE layer's TP style: it sees every token of the sequence on each TP rank.

    The sequence-sharded input is gathered, the MoE computes on plain tensors (its experts are
    sharded by the ``ep`` section), and its output is sharded on the sequence again.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_tokens_for_moe(module, device_mesh)
        return module


MOE_RULES = (
    # router gate and shared experts replicated (every rank routes the whole sequence)
    ShardingRule("layers.*.moe.router.gate", lambda o: NoParallel()),
    ShardingRule("layers.*.moe.shared_experts", lambda o: NoParallel()),
    ShardingRule("layers.*.moe", lambda o: ReplicateTokensForMoE()),
)
"""The MoE layer of every MoE block under TP (the routed experts: :data:`MOE_EXPERT_RULES`)."""

MOE_DECODER_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + GQA_ATTENTION_RULES + DENSE_FFN_RULES + MOE_RULES,
    ep=MOE_EXPERT_RULES,
    cp=ROPE_CP_RULES,
    description="MoE decoder with grouped-query attention (Qwen 3 MoE)",
)
"""The grouped-query-attention MoE decoder's table: TP with sequence parallel (the dense plan
for embedding, norms, attention and dense first blocks, and :data:`MOE_RULES` for the MoE
layers), the routed experts (:data:`MOE_EXPERT_RULES`) and the RoPE table under CP."""


def apply_tp_to_moe_decoder(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    *,
    sharding: ShardingConfig = MOE_DECODER_SHARDING,
) -> None:
    """Megatron-style TP with sequence parallel for an MoE decoder, from its sharding table.

    Args:
        model: The MoE decoder (or a pipeline stage of it).
        tp_mesh: 1-D tensor-parallel mesh.
        loss_parallel: Keep the logits sharded on the vocabulary.
        sharding: Keyword-only; the family's table (default :data:`MOE_DECODER_SHARDING`;
            DeepSeek-V3 passes its latent-attention table).

    Raises:
        ValueError: A head count not divisible by the TP degree, or tied embeddings.

    See Also:
        :titan:`torchtitan.models.qwen3.infra.parallelize.apply_non_moe_tp` and
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.apply_moe_ep_tp`.
    """
    check_tp_degree(model, tp_mesh)
    apply_sharding(model, sharding, tp_mesh, loss_parallel=loss_parallel)


def moe_layout_error(parallel_dims: ParallelDims, model_args: Any) -> str | None:
    """Why this layout cannot train this MoE model, or None when it can (checked up front).

    Args:
        parallel_dims: The degrees (no mesh needed).
        model_args: The MoE model's arguments (``moe_args``, ``moe_hidden_dim``).

    Returns:
        A message naming the values, or None.

    See Also:
        :func:`hp_trainer.distributed.layout_validation.validate_parallel_layout`, which raises it.
    """
    dims = parallel_dims
    if dims.tp > 1 and model_args.n_heads % dims.tp != 0:
        return (
            f"parallelism.tensor_parallel_degree = {dims.tp} must divide the attention's "
            f"{model_args.n_heads} heads"
        )
    num_experts = model_args.moe_args.num_experts
    if dims.ep > 1 and num_experts % dims.ep != 0:
        return (
            f"parallelism.expert_parallel_degree = {dims.ep} must divide the model's "
            f"{num_experts} experts"
        )
    if dims.tp > 1 and model_args.moe_hidden_dim % dims.tp != 0:
        return (
            f"parallelism.tensor_parallel_degree = {dims.tp} must divide the experts' hidden "
            f"size {model_args.moe_hidden_dim}"
        )
    if dims.tp > 1 and dims.ep > 1 and dims.dp_shard % dims.ep != 0:
        return (
            f"expert_parallel_degree = {dims.ep} with tensor_parallel_degree = {dims.tp}: the "
            "experts are sharded over tp too, so ep borrows its ranks from FSDP alone and must "
            f"divide data_parallel_shard_degree = {dims.dp_shard}"
        )
    moe_args = model_args.moe_args
    if dims.cp > 1 and moe_args.aux_loss_coeff > 0 and moe_args.aux_loss_type == "sequence":
        return (
            f"the model's aux_loss_type = 'sequence' with context_parallel_degree = {dims.cp}: "
            "the sequence-wise auxiliary loss needs whole sequences on each rank; expected "
            "aux_loss_type = 'batch' or context_parallel_degree = 1"
        )
    return None


def _dispatcher_options(job_config: JobConfig) -> dict[str, bool]:
    """The ``--moe`` dispatcher switches that are on, as ``ExpertParallel`` /
    ``ExpertTensorParallel`` options."""
    moe = job_config.moe
    options = {"dedup": moe.dedup_dispatch, "overlap_backward": moe.overlap_backward}
    return {name: value for name, value in options.items() if value}


def _expert_tp_meshes(dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh]:
    """``([ep, tp] mesh, efsdp mesh)`` when experts are tensor parallel: ep borrows dp_shard.

    Under HSDP the efsdp mesh is ``(dp_replicate, efsdp)``: the replicas hold the same experts.
    """
    world = dims.get_mesh("world")
    split = world._unflatten(2, (dims.dp_shard // dims.ep, dims.ep), ("etp_efsdp", "etp_ep"))
    edp = split["dp_replicate", "etp_efsdp"] if dims.dp_replicate > 1 else split["etp_efsdp"]
    return split["etp_ep", "tp"], edp


def parallelize_moe_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    *,
    sharding: ShardingConfig = MOE_DECODER_SHARDING,
    tp_sharding: ShardingConfig | None = None,
) -> nn.Module:
    """Apply TP, EP, CP, activation checkpointing, compile and FSDP to an MoE decoder.

    Routed experts: over ``ep`` (:class:`hp_cp_ep.ExpertParallel`), with TP also over ``tp``
    (:class:`hp_cp_ep.ExpertTensorParallel` on ``[ep, tp]``: ep then borrows from
    ``dp_shard`` alone, TorchTitan's ``expert_tensor_parallel_degree = tp``), or with TP alone
    over ``tp`` (:class:`hp_cp_ep.TensorParallel`). FSDP shards every block over the
    data-parallel mesh and the experts, as a second parameter group of the block's unit, over
    the expert-data-parallel mesh (the ranks holding the same experts). FSDP's gradient division
    is off: the trainer divides the loss by the global token count. The optional auxiliary
    load-balancing loss of each MoE layer counts the tokens of all ``dp x cp`` ranks
    (``MoE.aux_loss_group``), so its gradient is that of one process routing them all.

    Args:
        model: A :class:`~hp_trainer.models.common.moe_decoder.MoEDecoder`.
        parallel_dims: Degrees and meshes (``build_mesh`` done when world size > 1).
        job_config: The job configuration.
        sharding: Keyword-only; the family's table (TP, EP and CP sections, applied by
            :func:`~hp_trainer.distributed.sharding.apply_sharding` in one call; default
            :data:`MOE_DECODER_SHARDING`).
        tp_sharding: Deprecated name of ``sharding`` (hp-trainer 0.1.4).

    Returns:
        The model, parallelized in place.

    Raises:
        ValueError: For a layout :func:`moe_layout_error` refuses (degrees not dividing the
            heads, the experts, their hidden size or ``dp_shard``; the sequence-wise
            auxiliary loss with context parallelism).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.parallelize_deepseekv3` and
        :titan:`torchtitan.models.qwen3.infra.parallelize.parallelize_qwen3`.
    """
    dims = parallel_dims
    problem = moe_layout_error(dims, model.args)
    if problem is not None:
        raise ValueError(problem)
    if tp_sharding is not None:
        warnings.warn(
            "parallelize_moe_decoder(tp_sharding=) is deprecated; pass sharding=",
            FutureWarning,
            stacklevel=2,
        )
        sharding = tp_sharding
    par = job_config.parallelism
    edp_mesh = dims.get_mesh("efsdp_mesh") if dims.ep_enabled else None
    tp_mesh = dims.get_mesh("tp") if dims.tp_enabled else None
    expert_mesh, layout = None, "ep"
    if tp_mesh is not None:
        check_tp_degree(model, tp_mesh)
        if dims.ep_enabled:  # experts over [ep, tp]; ep borrows from dp_shard alone
            expert_mesh, edp_mesh = _expert_tp_meshes(dims)
            layout = "ep_tp"
        else:
            expert_mesh, layout = tp_mesh, "tp"
    elif dims.ep_enabled:
        expert_mesh = dims.get_mesh("ep")
        node = job_config.moe.dedup_ranks_per_node
        if node > 1:  # two-stage dedup dispatch: [inter, intra], rank = inter * node + intra
            expert_mesh = expert_mesh._unflatten(
                0, (dims.ep // node, node), ("ep_inter", "ep_intra")
            )
    apply_sharding(
        model,
        sharding,
        tp_mesh,
        expert_mesh=expert_mesh,
        expert_layout=layout,
        cp_mesh=dims.get_mesh("cp") if dims.cp_enabled else None,
        loss_parallel=not par.disable_loss_parallel,
        dispatcher=_dispatcher_options(job_config) if layout != "tp" else None,
    )
    if dims.dp_degree * dims.cp > 1:
        # the auxiliary loss counts the tokens of every rank that routes others (dp x cp):
        # each rank's share sums, with the gradients, to the loss of one process
        loss_group = dims.get_mesh("dp_cp").get_group()
        for block in model.get_submodule("layers").children():
            moe = getattr(block, "moe", None)
            if moe is not None:
                moe.aux_loss_group = loss_group
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable:
        # a checkpoint cannot be traced around the context-parallel attention (a graph break)
        apply_compile(model, job_config.compile, inside_checkpoint=dims.cp_enabled)
    if dims.dp_enabled or dims.cp_enabled:  # CP alone: FSDP over cp sums the shards' grads
        training = job_config.training
        apply_fsdp_to_decoder(
            model,
            dims.get_mesh("fsdp_mesh"),
            param_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_param],
            reduce_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_reduce],
            pp_enabled=dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward_policy=par.fsdp_reshard_after_forward,
            ep_degree=dims.ep,
            edp_mesh=edp_mesh,
            enable_symm_mem=par.enable_symm_mem,
        )
        disable_fsdp_gradient_division(model)
    return model
