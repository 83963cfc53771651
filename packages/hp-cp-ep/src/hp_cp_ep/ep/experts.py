"""Routed experts: ``E`` SwiGLU feed-forward networks stored as 3-D weights.

``w1`` and ``w3`` are ``[E, hidden, dim]``, ``w2`` is ``[E, dim, hidden]``; expert ``e`` computes
``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``. The rows arrive grouped by expert with a count per
expert, so all experts run as three grouped GEMMs (``torch._grouped_mm`` with cumulative row
offsets), or, where that kernel does not apply, as a loop of one matmul per expert with rows.

When ``torch._grouped_mm`` applies (checked per call, see :func:`grouped_mm_supported`): on CPU in
fp32 and bf16, on accelerators in bf16 (CUDA needs compute capability 9.0 or newer: pass
``use_grouped_mm=False`` on older GPUs), and only when every row stride is a multiple of 16
bytes (``dim`` and ``hidden`` times the element size); under ``torch.compile`` in bf16 only.
Otherwise the per-expert loop runs: same result, more kernel launches, and one host sync to
split the rows (none when the dispatch already read the counts on the host, as it does under
expert parallelism). Experts that receive no rows contribute nothing and get zero gradients
either way.

With ``fused=True`` the experts run through :func:`hp_kernels.mega_moe`, one custom op for the
grouped SwiGLU (its Triton kernel on CUDA, ``torch_npu``'s grouped matmul on Ascend, the
composed reference elsewhere), with no host sync on any device; on one device
:class:`hp_cp_ep.MoE` hands it the routing too (:meth:`GroupedExperts.routed`), so permutation,
experts and combine are one op.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hp_cp_ep._torch_compat import grouped_mm
from hp_cp_ep.ep.dispatch import TokenDispatcher
from hp_dtensor import device as hp_device
from hp_kernels import mega_moe

__all__ = ["GroupedExperts", "grouped_mm_supported"]

_GROUPED_MM_ALIGN_BYTES = 16


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply ``x`` by these per-expert weights here.

    Args:
        x: ``[N, K]`` rows.
        *weights: ``[E, M, K]`` weights (all inner dimensions are checked for alignment).

    Returns:
        ``True`` when the dtype is fp32/bf16 on CPU or bf16 on an
        accelerator (bf16 only under ``torch.compile``, whose tracing uses the kernel's meta
        function), and every inner dimension times the element size is a multiple of 16 bytes.

    See Also:
        :pt:`torch._grouped_mm`: the kernel; TorchTitan's :titan:`GroupedExperts` makes the same
        choice with its ``use_grouped_mm`` flag.
    """
    dtypes = {x.dtype, *(w.dtype for w in weights)}
    if len(dtypes) != 1:
        return False
    dtype = x.dtype
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False  # torch 2.13's meta kernel (used while tracing) accepts bf16 only
    if hp_device.is_accelerator(x.device):
        if dtype != torch.bfloat16:
            return False
    elif dtype not in (torch.float32, torch.bfloat16):
        return False
    dims = {x.shape[-1], *(d for w in weights for d in w.shape[1:])}
    return all(d * x.element_size() % _GROUPED_MM_ALIGN_BYTES == 0 for d in dims)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank-local block of an expert weight (a DTensor under expert / tensor parallelism)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _grouped_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    op = grouped_mm
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    hidden = F.silu(op(x, w1.transpose(-2, -1), offs=offsets)) * op(
        x, w3.transpose(-2, -1), offs=offsets
    )
    out: torch.Tensor = op(hidden, w2.transpose(-2, -1), offs=offsets)
    return out


def _looped_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    if sizes is None:  # a host sync: the split needs the counts on the host
        sizes = [int(n) for n in num_tokens_per_expert.tolist()]
    outputs = []
    for expert, rows in enumerate(torch.split(x, sizes, dim=0)):
        if rows.shape[0] == 0:
            continue
        hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())
        outputs.append(hidden @ w2[expert].t())
    if not outputs:
        return _no_rows(x, w1, w2, w3)
    return torch.cat(outputs, dim=0)


def _no_rows(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The ``[0, dim]`` result for no rows, still linked to ``x`` and the weights.

    Under EP a rank whose experts receive no tokens must still take part in the backward's
    combine all-to-all: a detached zeros tensor made its backward skip it while the peers waited
    there (a hang), and ``torch._grouped_mm``'s backward rejects zero rows. An empty product is
    linked, costs nothing and gives the weights zero gradients.
    """
    hidden = F.silu(x @ w1[0].t()) * (x @ w3[0].t())
    return hidden @ w2[0].t()


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with 3-D weights (TorchTitan's ``GroupedExperts``).

    The forward takes rows already grouped by expert (see :class:`hp_cp_ep.MoE`) and the row
    count of every expert. Under expert parallelism (:class:`hp_cp_ep.ExpertParallel`) the
    weights are DTensors sharded on the expert dimension, the rows of all experts are dispatched
    to the ranks holding them and the outputs returned; ``token_dispatcher`` does that (the
    identity on one device).

    Args:
        dim: Model dimension.
        hidden_dim: Hidden dimension of each expert.
        num_experts: Number of experts ``E``.
        use_grouped_mm: Use ``torch._grouped_mm`` where it applies (see
            :func:`grouped_mm_supported`); ``False`` always loops over experts.
        fused: Keyword-only extension: compute through the fused op :func:`hp_kernels.mega_moe`
            (no host sync; ``use_grouped_mm`` is then not consulted). Bitwise equal to the
            unfused path on the CPU wherever ``torch._grouped_mm`` applies (the reference kernel
            runs the same ops), equal to rounding elsewhere.

    Example:
        >>> import torch
        >>> from hp_cp_ep import GroupedExperts
        >>> experts = GroupedExperts(dim=8, hidden_dim=16, num_experts=3)
        >>> experts.init_weights(0.02)
        >>> experts(torch.randn(5, 8), torch.tensor([2, 0, 3])).shape
        torch.Size([5, 8])

    See Also:
        :titan:`torchtitan.models.moe.GroupedExperts`: TorchTitan's experts.
    """

    #: Dimension of each weight that indexes the expert's hidden units (split by TP).
    hidden_dim_of_weight: ClassVar[dict[str, int]] = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        *,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        self.fused = fused
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.token_dispatcher = TokenDispatcher(num_experts)
        self.init_weights(0.02)

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal init: ``w1`` with std 0.02, ``w2`` and ``w3`` with ``init_std``."""
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)

    def compute(
        self,
        x: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Run the rank-local experts on rows grouped by local expert (no communication).

        Args:
            x: Rows grouped by local expert.
            num_tokens_per_expert: ``[E_local]`` rows per local expert.
            sizes: The same counts as Python ints when already known on the host
                (``sizes`` of :class:`hp_cp_ep.DispatchedTokens`): the
                per-expert loop then splits the rows without a host sync.
        """
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        local_weights = getattr(self.token_dispatcher, "local_weights", None)
        if local_weights is not None:  # hot-expert replicas: own experts, then the replicas
            w1, w2, w3 = local_weights(w1, w2, w3)
        if num_tokens_per_expert.numel() != w1.shape[0]:
            raise ValueError(
                f"num_tokens_per_expert has {num_tokens_per_expert.numel()} entries but this "
                f"rank holds {w1.shape[0]} experts"
            )
        w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
        if x.shape[0] == 0:  # known on the host (the split sizes): no sync
            return _no_rows(x, w1, w2, w3)
        if self.fused:  # the expert of every row from the counts, on the device
            ends = torch.cumsum(num_tokens_per_expert, dim=0)
            rows = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
            row_expert = torch.searchsorted(ends, rows, right=True)
            return mega_moe(x, row_expert, None, w1, w2, w3)
        if self.use_grouped_mm and grouped_mm_supported(x, w1, w2, w3):
            return _grouped_swiglu(x, w1, w2, w3, num_tokens_per_expert)
        return _looped_swiglu(x, w1, w2, w3, num_tokens_per_expert, sizes)

    def fuses_routing(self) -> bool:
        """Whether :meth:`routed` applies: ``fused`` and the experts are all on this device
        (the identity dispatcher: no expert or tensor parallelism)."""
        d = self.token_dispatcher
        return (
            self.fused and type(d) is TokenDispatcher and d.ep_group is None and d.tp_group is None
        )

    def routed(
        self,
        tokens: torch.Tensor,
        expert_indices: torch.Tensor,
        probs: torch.Tensor,
        *,
        score_before_experts: bool,
    ) -> torch.Tensor:
        """Permute, run the experts and combine in one :func:`hp_kernels.mega_moe` call.

        Args:
            tokens: ``[T, dim]`` tokens (not permuted).
            expert_indices: ``[T, k]`` routed experts.
            probs: ``[T, k]`` routing weights.
            score_before_experts: Scale the experts' inputs (``True``) or outputs.

        Returns:
            ``[T, dim]``: what ``permute_tokens``, :meth:`compute` and ``unpermute_tokens``
            return (bitwise on the CPU where ``torch._grouped_mm`` applies).

        Raises:
            ValueError: When :meth:`fuses_routing` is false (not fused, or experts distributed).
        """
        if not self.fuses_routing():
            raise ValueError(
                "GroupedExperts.routed needs fused=True and a local token dispatcher (no expert "
                f"or tensor parallelism); got fused={self.fused} and "
                f"{type(self.token_dispatcher).__name__} with ep_group="
                f"{getattr(self.token_dispatcher, 'ep_group', None)}"
            )
        w1, w2, w3 = (_local(w).to(tokens.dtype) for w in (self.w1, self.w2, self.w3))
        return mega_moe(
            tokens, expert_indices, probs, w1, w2, w3, score_before_experts=score_before_experts
        )

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Experts' outputs for ``x`` (``[N, dim]`` grouped by global expert), same row order.

        Args:
            x: Rows grouped by expert.
            num_tokens_per_expert: ``[E]`` rows per expert (summing to ``N``).
        """
        dispatched = self.token_dispatcher.dispatch(x, num_tokens_per_expert)
        out = self.compute(
            dispatched.wait(), dispatched.num_tokens_per_expert, sizes=dispatched.sizes
        )
        return self.token_dispatcher.combine(out, dispatched)
