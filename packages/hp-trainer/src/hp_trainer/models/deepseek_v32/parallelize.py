"""DeepSeek-V3.2's parallelize function and its sharding table (``DEEPSEEK_V32_SHARDING``):
DeepSeek-V3's latent attention and MoE plan, the lightning indexer replicated over the TP ranks;
the indexer's training stage from the job's ``[dsa]`` section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from hp_cp_ep import MoE
from hp_cp_ep.dsa import (
    DSAIndexerContextParallel,
    DSAIndexerLossContextParallel,
    DSASparseAttentionContextParallel,
)
from hp_tp import NoParallel
from hp_trainer._parallel_api import ParallelStyle, PrepareModuleInput
from hp_trainer.distributed.sharding import ComposedStyle
from hp_trainer.models.common.expert_parallel import (
    MOE_EXPERT_RULES,
    MOE_RULES,
    parallelize_moe_decoder,
)
from hp_trainer.models.common.tensor_parallel import DENSE_FFN_RULES, ROPE_CP_RULES, TRUNK_RULES
from hp_trainer.models.deepseek_v3.parallelize import (
    LATENT_ATTENTION_RULES,
    LatentAttentionParallel,
)
from hp_trainer.models.deepseek_v32.model import INDEXER_STAGES, DSAttention
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "DEEPSEEK_V32_SHARDING",
    "SPARSE_ATTENTION_RULES",
    "apply_dsa_context_parallel",
    "configure_indexer_training",
    "parallelize_deepseek_v32",
]


class _IndexerTargetOverHeads(ParallelStyle):
    """Give the attention its TP group: the indexer's target sums the heads of every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, DSAttention):
            raise TypeError(f"expected a DSAttention, got {type(module).__name__}")
        module.head_group = device_mesh.get_group()
        return module


_SEQ = Shard(1)
_ATTENTION = "layers.*.attention"

SPARSE_ATTENTION_RULES = (
    # the indexer is small: every TP rank computes all of it (the same top-k everywhere)
    ShardingRule("layers.*.attention.indexer.wq_b", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.indexer.wk", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.indexer.k_norm", lambda o: NoParallel()),
    ShardingRule("layers.*.attention.indexer.weights_proj", lambda o: NoParallel()),
    *(rule for rule in LATENT_ATTENTION_RULES if rule.pattern != _ATTENTION),
    ShardingRule(
        _ATTENTION,
        lambda o: ComposedStyle(
            LatentAttentionParallel(),
            _IndexerTargetOverHeads(),
            PrepareModuleInput(
                input_layouts=(_SEQ, None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            ),
        ),
    ),
)
"""DeepSeek-V3's latent-attention rules (heads split over TP) with the lightning indexer
replicated: every rank selects the same tokens, and the indexer's KL target sums the
attention probabilities of every rank's heads (one all-reduce of ``(batch, seq, keys)``)."""

DEEPSEEK_V32_SHARDING = ShardingConfig(
    tp=TRUNK_RULES + SPARSE_ATTENTION_RULES + DENSE_FFN_RULES + MOE_RULES,
    ep=MOE_EXPERT_RULES,
    cp=ROPE_CP_RULES,
    description="DeepSeek-V3.2 (sparse latent attention, MoE)",
)
"""DeepSeek-V3.2's table, DeepSeek-V3's TP and EP sections with ``SPARSE_ATTENTION_RULES``;
under CP the RoPE table is sharded with the sequence (the attention's own context parallelism is
hp-cp-ep's DSA styles, applied by :func:`hp_trainer.parallelize_deepseek_v32`)."""


def configure_indexer_training(
    model: nn.Module, stage: str, coeff: float, tokens_per_step: int | None = None
) -> list[DSAttention]:
    """Set the lightning indexers' training stage on every DSA attention of ``model``.

    Every :class:`~hp_trainer.models.deepseek_v32.model.DSAttention` gets the stage, the
    coefficient and the divisor.

    ``"dense_warmup"`` freezes every parameter but the indexers' (``requires_grad`` off) and
    the MoE routing bias (its update rate set to None), as DeepSeek-V3.2's warm-up trains the
    indexer alone against dense attention; ``"sparse"`` trains everything, the indexer by its
    own loss only.

    Args:
        model: A DeepSeek-V3.2 model (or a pipeline stage of one).
        stage: ``"dense_warmup"`` or ``"sparse"``.
        coeff: Weight of the indexer's KL loss (0: the indexer is not trained).
        tokens_per_step: The step's query count over every rank and micro-batch (the loss's
            divisor, so that the shares add up to one mean); None: each forward's mean.

    Returns:
        The configured attention modules.

    Raises:
        ValueError: An unknown stage, a negative coefficient, or a model without
            :class:`~hp_trainer.models.deepseek_v32.model.DSAttention`.
    """
    if stage not in INDEXER_STAGES:
        raise ValueError(f"indexer stage must be one of {INDEXER_STAGES}, got {stage!r}")
    if coeff < 0:
        raise ValueError(f"the indexer loss coefficient must be >= 0, got {coeff}")
    attentions = [m for m in model.modules() if isinstance(m, DSAttention)]
    if not attentions and any(True for _ in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no DSAttention to configure")
    for attention in attentions:
        attention.indexer_stage = stage  # type: ignore[assignment]
        attention.indexer_loss_coeff = coeff
        attention.indexer_loss_tokens = tokens_per_step
    if stage == "dense_warmup":
        indexer_params = {id(p) for a in attentions for p in a.indexer.parameters()}
        for param in model.parameters():
            if id(param) not in indexer_params:
                param.requires_grad_(False)
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.load_balance_coeff = None
    return attentions


def parallelize_deepseek_v32(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Set the indexer's stage (``[dsa]``), then apply TP, EP, AC, compile and FSDP.

    The indexer loss is divided by the step's global query count (global batch x sequence
    length), so every rank's and micro-batch's share adds up to one mean over the step, as in
    one process.

    Args:
        model: The DeepSeek-V3.2 decoder.
        parallel_dims: Degrees and meshes (``build_mesh`` done).
        job_config: The job configuration.

    Returns:
        The parallelized model (modified in place).

    Raises:
        ValueError: ``model.index_topk`` over ``training.seq_len`` (a flavor from
            config.json, which the parse-time check cannot see).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.infra.parallelize.parallelize_deepseekv3`.
    """
    from hp_trainer.models.deepseek_v32.checks import index_topk_error

    training = job_config.training
    problem = index_topk_error(model.args, training.seq_len)
    if problem is not None:
        raise ValueError(problem)
    global_batch = training.global_batch_size
    if global_batch == -1:
        global_batch = training.local_batch_size * parallel_dims.dp_degree
    dsa = job_config.dsa
    configure_indexer_training(
        model, dsa.indexer_stage, dsa.indexer_loss_coeff, global_batch * training.seq_len
    )
    if parallel_dims.cp_enabled:
        apply_dsa_context_parallel(
            model,
            parallel_dims.get_mesh("cp"),
            job_config.parallelism.context_parallel_rotate_method,
        )
    return parallelize_moe_decoder(model, parallel_dims, job_config, sharding=DEEPSEEK_V32_SHARDING)


def apply_dsa_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, rotate_method: str = "allgather"
) -> list[DSAttention]:
    """Make every DSA attention's selection, sparse attention and indexer loss context-parallel.

    hp-cp-ep's DSA styles go on each
    :class:`~hp_trainer.models.deepseek_v32.model.DSAttention` (the model code is unchanged).

    The sequence is sharded head-tail (load-balanced), as the trainer's context-parallel step
    cuts it: the indexer's keys travel (``allgather``, or a ring overlapped with the scoring for
    ``ring`` / ``alltoall``), the top-k holds global positions, and only the selected
    compressed rows (and indexer keys for the loss) are fetched from the ranks that own them.

    Args:
        model: A DeepSeek-V3.2 model (or pipeline stage).
        cp_mesh: The 1-D context-parallel mesh.
        rotate_method: ``allgather``, ``ring`` or ``alltoall`` (``[parallelism]
            context_parallel_rotate_method``).

    Returns:
        The attention modules made context-parallel.

    See Also:
        ``hp_cp_ep.dsa.DSAIndexerContextParallel``,
        ``hp_cp_ep.dsa.DSASparseAttentionContextParallel``,
        ``hp_cp_ep.dsa.DSAIndexerLossContextParallel``;
        :pt:`torch.distributed.tensor.parallel.ParallelStyle`.
    """
    attentions = [m for m in model.modules() if isinstance(m, DSAttention)]
    for attention in attentions:
        DSAIndexerContextParallel(load_balance=True, rotate_method=rotate_method)._apply(
            attention, cp_mesh
        )
        DSASparseAttentionContextParallel(load_balance=True)._apply(attention, cp_mesh)
        DSAIndexerLossContextParallel(load_balance=True)._apply(attention, cp_mesh)
    return attentions
