"""Context parallel attention: ring, Ulysses, all-gather-KV and their 2-D hybrids.

One engine (:class:`ContextParallelAttention`) and two fronts over it: PyTorch's functional
``context_parallel`` context manager and HyperParallel's ``ContextParallel`` module style.
TorchTitan's trainer-side ``create_context_parallel_ctx`` lives in hp-trainer
(``hp_trainer.distributed.context_parallel``).

See Also:
    :pt:`torch.distributed.tensor.experimental.context_parallel`
"""

from hp_cp_ep.cp.attention import CP_MODES, ContextParallelAttention
from hp_cp_ep.cp.functional import (
    context_parallel,
    context_parallel_attention,
    context_parallel_unshard,
    get_rotate_method,
    set_rotate_method,
)
from hp_cp_ep.cp.load_balance import shard_sequence, unshard_sequence
from hp_cp_ep.cp.style import AsyncContextParallel, ContextParallel

__all__ = [
    "CP_MODES",
    "AsyncContextParallel",
    "ContextParallel",
    "ContextParallelAttention",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_unshard",
    "get_rotate_method",
    "set_rotate_method",
    "shard_sequence",
    "unshard_sequence",
]
