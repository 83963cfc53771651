"""DeepSeek sparse attention (DSA): the lightning indexer's top-k, sparse attention, and both
under context parallelism.

See Also:
    :pt:`torch.nn.functional.scaled_dot_product_attention`
"""

from hp_cp_ep.dsa.functional import indexer_scores, indexer_topk, sparse_attention

__all__ = ["indexer_scores", "indexer_topk", "sparse_attention"]
