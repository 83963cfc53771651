"""DeepSeek sparse attention (DSA): the lightning indexer's top-k, sparse attention, and both
under context parallelism (HyperParallel's DSA context-parallel family).

See Also:
    :pt:`torch.nn.functional.scaled_dot_product_attention`
"""

from hp_cp_ep.dsa.context_parallel import (
    DSA_ROTATE_METHODS,
    GatherPlan,
    context_parallel_indexer_topk,
    context_parallel_sparse_attention,
    context_parallel_sparse_indexer_loss,
    plan_sparse_gather,
)
from hp_cp_ep.dsa.functional import (
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_indexer_loss,
    sparse_latent_attention,
)
from hp_cp_ep.dsa.style import (
    AsyncDSAIndexerContextParallel,
    AsyncDSAIndexerLossContextParallel,
    AsyncDSASparseAttentionContextParallel,
    DSAGatherCache,
    DSAIndexerContextParallel,
    DSAIndexerLossContextParallel,
    DSASparseAttentionContextParallel,
)

__all__ = [
    "DSA_ROTATE_METHODS",
    "AsyncDSAIndexerContextParallel",
    "AsyncDSAIndexerLossContextParallel",
    "AsyncDSASparseAttentionContextParallel",
    "DSAGatherCache",
    "DSAIndexerContextParallel",
    "DSAIndexerLossContextParallel",
    "DSASparseAttentionContextParallel",
    "GatherPlan",
    "context_parallel_indexer_topk",
    "context_parallel_sparse_attention",
    "context_parallel_sparse_indexer_loss",
    "indexer_scores",
    "indexer_topk",
    "plan_sparse_gather",
    "sparse_attention",
    "sparse_indexer_loss",
    "sparse_latent_attention",
]
