"""Fused communication-path ops and the communication interfaces of hyper-parallel.

Every op is a ``torch.library`` custom op in the ``hp_kernels`` namespace with a pure-torch
reference kernel (any device), a fake (meta) kernel and, where differentiable, autograd:

- FSDP all-gather path: :func:`all_gather_copy_in`, :func:`all_gather_copy_out`,
  :func:`unpadded_views`;
- FSDP reduce-scatter path: :func:`reduce_scatter_copy_in` (PyTorch FSDP2's exact layout),
  :func:`post_reduce`, :func:`gradient_divide_factors`, :func:`reduce_scatter_numel`;
- expert parallel: :func:`permute_tokens`, :func:`unpermute_tokens`, and the grouped-GEMM
  layout :func:`permute_tokens_aligned` / :func:`unpermute_tokens_aligned`;
- fused MoE experts: :func:`mega_moe` (permute, grouped SwiGLU GEMMs, combine in one op) and its
  backward :func:`mega_moe_grad`;
- ring attention: :func:`merge_attention_partials`.

Communication interfaces with PyTorch FSDP2's call contract: :class:`AllGather`,
:class:`ReduceScatter`, :class:`AllReduce`, their process-group defaults and
:class:`Bf16AllToAllReduceScatter`.

See Also:
    :pt:`torch.library`: PyTorch's custom-op API.
"""

from hp_kernels.__about__ import __version__
from hp_kernels.all_gather import all_gather_copy_in, all_gather_copy_out, unpadded_views
from hp_kernels.attention import merge_attention_partials
from hp_kernels.comm import (
    AllGather,
    AllReduce,
    Bf16AllToAllReduceScatter,
    Comm,
    DefaultAllGather,
    DefaultAllReduce,
    DefaultReduceScatter,
    ReduceScatter,
)
from hp_kernels.device_kernels import (
    OP_NAMES,
    has_device_kernel,
    reference_kernel,
    register_device_kernel,
    register_shipped_kernels,
    shipped_device_kernels,
)
from hp_kernels.mega_moe import mega_moe, mega_moe_grad
from hp_kernels.moe import permute_tokens, unpermute_tokens
from hp_kernels.moe_aligned import permute_tokens_aligned, unpermute_tokens_aligned
from hp_kernels.reduce_scatter import (
    gradient_divide_factors,
    post_reduce,
    reduce_scatter_copy_in,
    reduce_scatter_numel,
)

register_shipped_kernels()
del register_shipped_kernels

__all__ = [
    "OP_NAMES",
    "AllGather",
    "AllReduce",
    "Bf16AllToAllReduceScatter",
    "Comm",
    "DefaultAllGather",
    "DefaultAllReduce",
    "DefaultReduceScatter",
    "ReduceScatter",
    "__version__",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "gradient_divide_factors",
    "has_device_kernel",
    "mega_moe",
    "mega_moe_grad",
    "merge_attention_partials",
    "permute_tokens",
    "permute_tokens_aligned",
    "post_reduce",
    "reduce_scatter_copy_in",
    "reduce_scatter_numel",
    "reference_kernel",
    "register_device_kernel",
    "shipped_device_kernels",
    "unpadded_views",
    "unpermute_tokens",
    "unpermute_tokens_aligned",
]
