"""The MoE layer: router, routed experts, optional shared experts, token permutation.

Forward for ``T`` tokens (TorchTitan's MoE semantics)::

    scores, experts, counts = router(x, expert_bias)      # top-k experts per token
    rows = permute_tokens(x, experts)                      # T*k rows grouped by expert
    (capacity: rows beyond an expert's capacity are dropped, in token order)
    (score_before_experts: rows *= their score)
    dispatched = experts.token_dispatcher.dispatch(rows)   # EP: async all-to-all issued ...
    shared = shared_experts(x)                             # ... overlapped with this
    out = experts.compute(dispatched.wait())               # grouped GEMM on local experts
    routed = experts.token_dispatcher.combine(out)         # EP: all-to-all back
    y = unpermute_tokens(routed, weights=scores or 1) + shared

The layer is *dropless* by default: every choice is computed. With ``capacity_factor`` set, each
expert takes at most ``ceil(capacity_factor * T * k / E)`` rows; the choices beyond it (the later
tokens) contribute zero and are not sent anywhere. With ``capacity_scope="ep_group"`` (GShard's
and DeepSeek's definition) ``T`` counts the tokens of the whole expert-parallel group and the
rows are ranked over the group (lower EP ranks first), so EP drops exactly the choices one
process holding the group's batch would; ``"local"`` (the default, unchanged) uses each rank's
own tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_cp_ep._torch_compat import in_backward, outside_backward
from hp_cp_ep.ep.dispatch import BackwardOverlap
from hp_cp_ep.ep.experts import GroupedExperts
from hp_cp_ep.ep.router import (
    TokenChoiceTopKRouter,
    count_choices,
    load_balancing_loss,
    sequence_balancing_loss,
)
from hp_cp_ep.ep.stats import ExpertLoad
from hp_kernels import permute_tokens, unpermute_tokens

__all__ = ["MoE", "MoEArgs", "SharedExperts"]


@dataclass(frozen=True)
class MoEArgs:
    """Options of a :class:`MoE` layer (TorchTitan's ``MoEArgs`` fields, plus two extensions).

    Attributes:
        num_experts: Routed experts ``E``.
        num_shared_experts: Shared experts (one SwiGLU of ``hidden_dim * num_shared_experts``
            applied to every token); 0 for none.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        route_norm: Normalise the top-k scores to sum to 1.
        route_scale: Scale applied to the top-k scores.
        score_before_experts: Multiply each row by its score before the experts (``True``) or
            weight the experts' outputs when combining (``False``).
        num_expert_groups: Expert groups for group-limited routing (``None``: off).
        num_limited_groups: Groups a token may reach.
        use_grouped_mm: Use ``torch._grouped_mm`` where it applies.
        top_k: Experts per token.
        load_balance_coeff: Step of the auxiliary-loss-free expert bias update (``None``: no
            bias).
        capacity_factor: Extension: ``None`` for dropless; else per-expert capacity factor.
        aux_loss_coeff: Extension: weight of the auxiliary load-balancing loss added to the
            backward (0: off).
        capacity_scope: Extension: ``"local"`` (each rank's tokens set the capacity) or
            ``"ep_group"`` (the expert-parallel group's tokens do, ranked over the group: one
            all-gather of ``E + 1`` integers per forward; the same as ``"local"`` without EP).
        aux_loss_type: Extension: ``"batch"`` (:func:`~hp_cp_ep.load_balancing_loss` over the
            routed batch) or ``"sequence"`` (DeepSeek-V3's sequence-wise loss,
            ``hp_cp_ep.ep.router.sequence_balancing_loss``, averaged over sequences: the input's
            second-to-last dimension is the sequence, a 2-D input one sequence; with
            ``aux_loss_group`` each rank must hold whole sequences).
        fused: Extension: the experts compute through :func:`hp_kernels.mega_moe` (see
            :class:`~hp_cp_ep.GroupedExperts`); without expert/tensor parallelism and capacity,
            permutation, experts and combine are that one op.
        _debug_force_load_balance: Route round-robin (debugging, benchmarks).

    See Also:
        :titan:`torchtitan.models.moe.MoEArgs`: TorchTitan's options.
    """

    num_experts: int = 8
    num_shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    score_before_experts: bool = True
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    use_grouped_mm: bool = True
    top_k: int = 1
    load_balance_coeff: float | None = 1e-3
    capacity_factor: float | None = None
    aux_loss_coeff: float = 0.0
    capacity_scope: Literal["local", "ep_group"] = "local"
    aux_loss_type: Literal["batch", "sequence"] = "batch"
    fused: bool = False
    _debug_force_load_balance: bool = False


class SharedExperts(nn.Module):
    """A SwiGLU feed-forward applied to every token, next to the routed experts.

    Args:
        dim: Model dimension.
        hidden_dim: Hidden dimension (``per-expert hidden * num_shared_experts``).

    See Also:
        :titan:`torchtitan.models.moe.FeedForward` used as TorchTitan's :titan:`shared_experts
        <MoE>`.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal init: ``w1`` with std 0.02, ``w2`` and ``w3`` with ``init_std``."""
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``w2(silu(w1 x) * w3 x)``."""
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; the backward also sends gradient 1 into ``aux_loss``.

    So the auxiliary loss trains the router without the training loop adding it to its loss.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer (TorchTitan's ``MoE`` interface).

    Takes ``[..., dim]`` tokens (any leading shape) and returns the same shape. Dropless by
    default; see :class:`MoEArgs` for the options. Buffers: ``expert_bias`` (``[E]`` fp32, when
    ``load_balance_coeff`` is set; persistent) and ``tokens_per_expert`` (``[E]`` fp32, this
    rank's routed choices accumulated since the last :func:`hp_cp_ep.update_expert_bias`;
    forwards recomputed by activation checkpointing are not counted again).
    After each forward ``aux_loss`` holds the (detached) auxiliary loss when it is enabled.
    Setting ``aux_loss_group`` (the ranks routing different tokens of one batch: data and
    context parallel) makes it this rank's share of the loss over all their tokens: the expert
    counts and token count are summed over the group (one all-reduce of ``E + 1`` values per
    forward), so the shares add up, as the gradient sum over the group does, to the loss of one
    process routing every token.

    Under :class:`hp_cp_ep.ExpertParallel` the dispatch all-to-all is issued before the shared
    experts run and waited for after, so the two overlap.

    Args:
        moe_args: The options.
        dim: Model dimension.
        hidden_dim: Hidden dimension of each expert.

    Raises:
        ValueError: For inconsistent options (see :class:`hp_cp_ep.TokenChoiceTopKRouter`), or a
            non-positive ``capacity_factor``.

    Example:
        >>> import torch
        >>> from hp_cp_ep import MoE, MoEArgs
        >>> moe = MoE(MoEArgs(num_experts=4, top_k=2), dim=8, hidden_dim=16)
        >>> moe(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])

    See Also:
        :titan:`torchtitan.models.moe.MoE`: TorchTitan's MoE layer; DeepSeek-V3's ``DeepseekV3MoE``.
    """

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int) -> None:
        super().__init__()
        if moe_args.capacity_factor is not None and moe_args.capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor must be positive or None, got {moe_args.capacity_factor}"
            )
        if moe_args.capacity_scope not in ("local", "ep_group"):
            raise ValueError(
                f"capacity_scope must be 'local' or 'ep_group', got {moe_args.capacity_scope!r}"
            )
        if moe_args.aux_loss_type not in ("batch", "sequence"):
            raise ValueError(
                f"aux_loss_type must be 'batch' or 'sequence', got {moe_args.aux_loss_type!r}"
            )
        self.moe_args = moe_args
        self.num_experts = moe_args.num_experts
        self.top_k = moe_args.top_k
        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=moe_args.num_experts,
            num_expert_groups=moe_args.num_expert_groups,
            num_limited_groups=moe_args.num_limited_groups,
            top_k=moe_args.top_k,
            score_func=moe_args.score_func,
            route_norm=moe_args.route_norm,
            route_scale=moe_args.route_scale,
            _debug_force_load_balance=moe_args._debug_force_load_balance,
        )
        self.experts = GroupedExperts(
            dim,
            hidden_dim,
            moe_args.num_experts,
            use_grouped_mm=moe_args.use_grouped_mm,
            fused=moe_args.fused,
        )
        self.shared_experts: SharedExperts | None = (
            SharedExperts(dim, hidden_dim * moe_args.num_shared_experts)
            if moe_args.num_shared_experts > 0
            else None
        )
        self.load_balance_coeff = moe_args.load_balance_coeff
        self.expert_bias: torch.Tensor | None
        if self.load_balance_coeff is not None:
            self.register_buffer(
                "expert_bias", torch.zeros(moe_args.num_experts, dtype=torch.float32)
            )
        else:
            self.expert_bias = None
        self.tokens_per_expert: torch.Tensor
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(moe_args.num_experts, dtype=torch.float32),
            persistent=False,
        )
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_group: dist.ProcessGroup | None = None
        self.last_load: ExpertLoad | None = None

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Initialise router, experts and shared experts; zero the bias and the counts."""
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.no_grad():
            if buffer_device is not None:
                self.tokens_per_expert = self.tokens_per_expert.to(buffer_device)
                if self.expert_bias is not None:
                    self.expert_bias = self.expert_bias.to(buffer_device)
            self.tokens_per_expert.zero_()
            if self.expert_bias is not None:
                self.expert_bias.zero_()

    def _capacity_mask(self, selected: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` bool: choices within their expert's capacity (earlier tokens first)."""
        factor = self.moe_args.capacity_factor
        assert factor is not None
        num_tokens = selected.shape[0]
        group = getattr(self.experts.token_dispatcher, "ep_group", None)
        if (
            self.moe_args.capacity_scope == "ep_group"
            and getattr(self.experts.token_dispatcher, "node_groups", None) is not None
        ):
            raise ValueError(
                "capacity_scope='ep_group' ranks choices over a flat EP group; the dispatcher "
                "has a node axis (inter, intra) instead: use capacity_scope='local'"
            )
        offset: torch.Tensor | None = None
        capacity: int | torch.Tensor
        if self.moe_args.capacity_scope == "ep_group" and group is not None:
            # every rank's choices per expert and token count: [ep, E + 1], no host read
            mine = count_choices(selected, self.num_experts)
            mine = torch.cat([mine, mine.new_full((1,), num_tokens)])
            table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(table, mine, group=group)
            stacked = torch.stack(table)
            rank = dist.get_rank(group)
            offset = stacked[:rank, :-1].sum(dim=0)  # choices of lower ranks, per expert
            # the float64 operations of the local path's math.ceil, in the same order
            total = stacked[:, -1].sum().to(torch.float64)
            capacity = torch.ceil(factor * total * self.top_k / self.num_experts).to(torch.int64)
        else:
            capacity = math.ceil(factor * num_tokens * self.top_k / self.num_experts)
        # The rank of each choice within its expert, in (token, choice) order, from one stable
        # sort: O(T k log(T k)) integer work, no [T k, E] one-hot, no host sync.
        flat = selected.reshape(-1)
        ordered = torch.sort(flat, stable=True)
        first = torch.searchsorted(ordered.values, ordered.values)  # start of each expert's run
        rank_sorted = torch.arange(flat.numel(), device=flat.device) - first
        position = torch.empty_like(rank_sorted).scatter_(0, ordered.indices, rank_sorted)
        if offset is not None:
            position = position + offset[flat]
        return (position < capacity).view_as(selected)

    def _aux_loss_share(self, scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """This rank's term of the auxiliary loss over the tokens of all of ``aux_loss_group``.

        ``E / (k T^2) * sum_e F_e * sum_t p_te`` with the group's counts ``F`` and token count
        ``T`` and this rank's normalised scores ``p``: summed over the group it is
        :func:`~hp_cp_ep.ep.router.load_balancing_loss` of all the tokens.
        """
        num_tokens, top_k = selected.shape
        stats = count_choices(selected, self.num_experts).float()
        stats = torch.cat([stats, stats.new_full((1,), float(num_tokens))])
        dist.all_reduce(stats, group=self.aux_loss_group)
        # no host sync: with no token anywhere the counts, hence the loss, are zero
        counts, total = stats[:-1].to(scores.dtype), stats[-1:].to(scores.dtype).clamp_min(1)
        probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        weight = counts * self.num_experts / (top_k * total * total)
        return (weight * probs.sum(dim=0)).sum()

    def _sequence_aux_loss(
        self, scores: torch.Tensor, selected: torch.Tensor, shape: torch.Size
    ) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise loss, averaged over the sequences of ``aux_loss_group``.

        Each rank holds whole sequences (data parallel); the number of sequences is summed over
        the group (one all-reduce of one value) so the ranks' shares add up to the mean over
        every sequence. A group that splits sequences (context parallel) is not supported.
        """
        seq_len = max(shape[-2] if len(shape) > 2 else shape[0], 1)
        summed = sequence_balancing_loss(scores, selected, self.num_experts, seq_len)
        num_seqs = scores.new_full((1,), float(selected.shape[0] // seq_len))
        if self.aux_loss_group is not None:
            dist.all_reduce(num_seqs, group=self.aux_loss_group)
        return (summed / num_seqs.clamp_min(1)).sum()

    def _routed_by_rows(
        self,
        dispatcher: Any,
        tokens: torch.Tensor,
        selected: torch.Tensor,
        top_scores: torch.Tensor,
        num_bins: int,
    ) -> torch.Tensor:
        """Routed (plus shared) output, one row per choice sent (:class:`TokenDispatcher`)."""
        if num_bins == self.num_experts and self.experts.fuses_routing():
            # one fused op: permute, experts, combine (hp_kernels.mega_moe)
            out = self.experts.routed(
                tokens,
                selected,
                top_scores.to(tokens.dtype),
                score_before_experts=self.moe_args.score_before_experts,
            )
            shared = self.shared_experts(tokens) if self.shared_experts is not None else None
            return out + shared if shared is not None else out
        rows, sorted_indices, counts = permute_tokens(tokens, selected, num_bins)
        weights = top_scores.to(tokens.dtype)
        if self.moe_args.score_before_experts:
            rows = rows * weights.reshape(-1)[sorted_indices].unsqueeze(-1)
        expert_counts = counts[: self.num_experts]
        # Dropped rows sort last and are not sent; the dispatch reads the counts on the host
        # once (the split sizes under EP, the kept rows otherwise), the layer's only host sync.
        dispatched = dispatcher.dispatch(rows, expert_counts, drop_tail=num_bins > self.num_experts)
        shared, overlap = self._shared(dispatcher, tokens)
        expert_out = self.experts.compute(
            dispatched.wait(), dispatched.num_tokens_per_expert, sizes=dispatched.sizes
        )
        if overlap is not None:
            routed = dispatcher.combine(expert_out, dispatched, overlap=overlap)
            shared = overlap.output
        else:
            routed = dispatcher.combine(expert_out, dispatched)
        kept = routed.shape[0]
        if kept < rows.shape[0]:
            routed = torch.cat([routed, routed.new_zeros((rows.shape[0] - kept, tokens.shape[-1]))])
        if self.moe_args.score_before_experts:
            out = unpermute_tokens(routed, sorted_indices, topk=self.top_k)
        else:
            out = unpermute_tokens(routed, sorted_indices, weights)
        return out + shared if shared is not None else out

    def _routed_by_tokens(
        self,
        dispatcher: Any,
        tokens: torch.Tensor,
        selected: torch.Tensor,
        top_scores: torch.Tensor,
    ) -> torch.Tensor:
        """Routed (plus shared) output with a de-duplicating dispatcher (one row per token and
        destination; the choices are weighted and summed on the experts' rank)."""
        handle = dispatcher.dispatch_tokens(
            tokens,
            selected,
            top_scores.to(tokens.dtype),
            score_before_experts=self.moe_args.score_before_experts,
        )
        shared, overlap = self._shared(dispatcher, tokens)
        expert_out = self.experts.compute(
            handle.wait(), handle.num_tokens_per_expert, sizes=handle.sizes
        )
        out: torch.Tensor = dispatcher.combine_tokens(expert_out, handle, overlap=overlap)
        if overlap is not None:
            shared = overlap.output
        return out + shared if shared is not None else out

    def _shared(
        self, dispatcher: Any, tokens: torch.Tensor
    ) -> tuple[torch.Tensor | None, BackwardOverlap | None]:
        """The shared experts' output, or the branch whose backward the combine overlaps."""
        if self.shared_experts is None:
            return None, None
        if getattr(dispatcher, "overlap_backward", False) and torch.is_grad_enabled():
            return None, BackwardOverlap(tokens, self.shared_experts)
        return self.shared_experts(tokens), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MoE to ``x`` of shape ``[..., dim]``."""
        if self.moe_args.fused and not getattr(self.experts, "fused", False):
            raise ValueError(
                f"MoEArgs.fused=True but the experts ({type(self.experts).__name__}) do not "
                "compute through hp_kernels.mega_moe (their fused is False): expected "
                "experts built with fused=True, or MoEArgs.fused=False"
            )
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router.route(tokens, self.expert_bias)
        # an activation checkpoint's recompute must not count twice
        with torch.no_grad():
            counts = routing.num_tokens_per_expert.to(torch.float32)
            if torch.compiler.is_compiling():  # decided when the graph runs, not when traced
                self.tokens_per_expert.add_(counts * outside_backward(counts))
            elif not in_backward():
                self.tokens_per_expert.add_(counts)
        selected = routing.selected_experts
        num_bins = self.num_experts
        if self.moe_args.capacity_factor is not None:
            # dropped choices go to an extra bin E that sorts last and is never computed
            keep = self._capacity_mask(selected)
            selected = torch.where(keep, selected, self.num_experts)
            num_bins += 1
        dispatcher = self.experts.token_dispatcher
        if getattr(dispatcher, "dispatches_tokens", False):
            # de-duplicating dispatch: tokens (not one row per choice) go to the experts' ranks
            out = self._routed_by_tokens(dispatcher, tokens, selected, routing.top_scores)
        else:
            out = self._routed_by_rows(dispatcher, tokens, selected, routing.top_scores, num_bins)
        if self.moe_args.aux_loss_coeff > 0 and self.training:
            if self.moe_args.aux_loss_type == "sequence":
                aux = self._sequence_aux_loss(routing.scores, routing.selected_experts, shape)
            elif self.aux_loss_group is None:
                aux = load_balancing_loss(
                    routing.scores, routing.selected_experts, self.num_experts
                )
            else:
                aux = self._aux_loss_share(routing.scores, routing.selected_experts)
            self.aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux * self.moe_args.aux_loss_coeff)  # type: ignore[no-untyped-call]
        return out.reshape(shape)
