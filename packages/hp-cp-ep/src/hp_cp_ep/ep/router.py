"""Token-choice top-k routing: which experts each token goes to, and with which weight.

The router scores every token against every expert (a bias-free linear ``gate``), turns the logits
into probabilities (softmax or sigmoid, in fp32), picks the top ``k`` experts per token and returns
their scores as combine weights. Two balancing mechanisms are offered:

- the *auxiliary loss* (Switch Transformer / DeepSeek-V3's sequence-balance loss, computed here
  over the routed batch): ``E / (k T) * sum_e count_e * mean_t p_{t,e}``, 1.0 at perfect balance;
- the *auxiliary-loss-free bias* (DeepSeek-V3): an ``expert_bias`` added to the scores for the
  *choice* only (the combine weights stay unbiased), nudged after every optimizer step toward
  balance (see :func:`hp_cp_ep.update_expert_bias`).

Group-limited routing (DeepSeek-V3's node-limited routing) first ranks groups of experts by the
sum of their two best scores, keeps the best ``num_limited_groups`` groups and picks the top ``k``
only among their experts, so each token reaches at most that many nodes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Router",
    "Routing",
    "TokenChoiceTopKRouter",
    "load_balancing_loss",
    "sequence_balancing_loss",
]

ScoreFunc = Literal["softmax", "sigmoid"]


def count_choices(selected_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 number of choices per expert, without a host sync.

    A scatter-add of ones rather than ``torch.bincount``, which reads the largest index on the
    host to size its output on an accelerator. Integer sums: exact and deterministic.
    """
    flat = selected_experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


class Routing(NamedTuple):
    """The routing of a batch of ``T`` tokens over ``E`` experts, top ``k`` per token.

    Fields: ``scores`` (``[T, E]`` fp32 probabilities, before any bias, normalisation or
    scaling), ``top_scores`` (``[T, k]`` combine weights of the chosen experts, normalised and
    scaled), ``selected_experts`` (``[T, k]`` int64 expert index per choice) and
    ``num_tokens_per_expert`` (``[E]`` int64 number of choices per expert).

    See Also:
        :titan:`torchtitan.models.moe.TokenChoiceTopKRouter.forward`, which returns the last three.
    """

    scores: torch.Tensor
    top_scores: torch.Tensor
    selected_experts: torch.Tensor
    num_tokens_per_expert: torch.Tensor


def load_balancing_loss(
    scores: torch.Tensor, selected_experts: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The auxiliary load-balancing loss of one routed batch.

    ``E / (k T) * sum_e f_e * P_e`` where ``f_e`` is the number of choices of expert ``e`` and
    ``P_e`` the mean over tokens of the (sum-normalised) score of ``e``; 1.0 when both are
    uniform, up to ``E`` when every token goes to one expert. Differentiable in ``scores``.

    Args:
        scores: ``[T, E]`` router probabilities.
        selected_experts: ``[T, k]`` chosen expert indices.
        num_experts: ``E``.

    Returns:
        A scalar tensor (0 for an empty batch).

    See Also:
        DeepSeek-V3 technical report, "complementary sequence-wise auxiliary loss"; Switch
        Transformer's load-balancing loss.
    """
    num_tokens, top_k = selected_experts.shape
    if num_tokens == 0:
        return scores.sum() * 0.0
    counts = count_choices(selected_experts, num_experts).to(scores.dtype)
    fraction = counts * (num_experts / (top_k * num_tokens))
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return (fraction * probs.mean(dim=0)).sum()


def sequence_balancing_loss(
    scores: torch.Tensor, selected_experts: torch.Tensor, num_experts: int, seq_len: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed (not averaged) over the sequences.

    The ``T`` tokens are ``T / seq_len`` consecutive sequences of ``seq_len`` tokens. For each
    sequence, with ``N_r = E`` routed experts, ``K_r = k`` choices per token and its ``S =
    seq_len`` tokens (DeepSeek-V3 technical report, eqs. 17-20)::

        f_i = N_r / (K_r S) * sum_t 1[expert i among token t's top k]
        s'_{i,t} = s_{i,t} / sum_j s_{j,t}
        P_i = 1/S * sum_t s'_{i,t}
        L_seq = sum_i f_i P_i

    This returns ``sum over sequences of L_seq`` so shares over ranks add up; divide by the
    number of sequences (and multiply by ``alpha``) for DeepSeek-V3's ``L_Bal``. Differentiable
    in ``scores``; 1.0 per sequence when both factors are uniform.

    Args:
        scores: ``[T, E]`` router probabilities.
        selected_experts: ``[T, k]`` chosen expert indices.
        num_experts: ``E``.
        seq_len: Tokens per sequence; must divide ``T``.

    Returns:
        A scalar tensor (0 for an empty batch).

    Raises:
        ValueError: ``seq_len`` is not positive or does not divide ``T``.

    See Also:
        :func:`load_balancing_loss`, the batch-wise loss; DeepSeek-V3 technical report,
        "complementary sequence-wise auxiliary loss".
    """
    num_tokens, top_k = selected_experts.shape
    if seq_len < 1 or num_tokens % seq_len != 0:
        raise ValueError(
            f"seq_len={seq_len} must be positive and divide the {num_tokens} routed tokens"
        )
    if num_tokens == 0:
        return scores.sum() * 0.0
    num_seqs = num_tokens // seq_len
    # per-sequence choice counts: one scatter-add into [num_seqs * E], no host sync
    seq_of_choice = torch.arange(num_tokens, device=scores.device) // seq_len
    flat = (seq_of_choice.unsqueeze(1) * num_experts + selected_experts).reshape(-1)
    counts = torch.zeros(num_seqs * num_experts, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    fraction = counts.view(num_seqs, num_experts).to(scores.dtype) * (
        num_experts / (top_k * seq_len)
    )
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    mean_probs = probs.view(num_seqs, seq_len, num_experts).mean(dim=1)
    return (fraction * mean_probs).sum()


class TokenChoiceTopKRouter(nn.Module):
    """Top-k token-choice router (TorchTitan's ``TokenChoiceTopKRouter`` interface).

    Args:
        dim: Model dimension of the tokens.
        num_experts: Number of routed experts ``E``.
        num_expert_groups: Groups of experts for group-limited routing (``None``: off). Must
            divide ``num_experts``.
        num_limited_groups: Groups each token may reach (required with ``num_expert_groups``).
        top_k: Experts per token; at most ``num_experts``.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        route_norm: Divide the top-k scores by their sum.
        route_scale: Multiply the (normalised) top-k scores by this factor.
        _debug_force_load_balance: Ignore the scores for the choice and route round-robin
            (token ``t`` to experts ``t*k .. t*k+k-1`` mod ``E``), for debugging and benchmarks.

    Raises:
        ValueError: For ``top_k`` outside ``[1, num_experts]``, groups that do not divide the
            experts, ``num_limited_groups`` missing or out of range, or a ``top_k`` larger than
            the experts reachable in the limited groups.

    Example:
        >>> import torch
        >>> from hp_cp_ep import TokenChoiceTopKRouter
        >>> router = TokenChoiceTopKRouter(dim=8, num_experts=4, top_k=2)
        >>> scores, experts, counts = router(torch.randn(5, 8))
        >>> scores.shape, experts.shape, int(counts.sum())
        (torch.Size([5, 2]), torch.Size([5, 2]), 10)

    See Also:
        :titan:`torchtitan.models.moe.TokenChoiceTopKRouter`: TorchTitan's router;
        DeepSeek-V3's node-limited routing (``n_group`` / ``topk_group``).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        top_k: int = 1,
        score_func: ScoreFunc = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        _debug_force_load_balance: bool = False,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_expert_groups is not None:
            if num_expert_groups < 1 or num_experts % num_expert_groups != 0:
                raise ValueError(
                    f"num_expert_groups={num_expert_groups} must be positive and divide "
                    f"num_experts={num_experts}"
                )
            if num_limited_groups is None or not 1 <= num_limited_groups <= num_expert_groups:
                raise ValueError(
                    f"num_limited_groups={num_limited_groups} must lie in [1, "
                    f"num_expert_groups={num_expert_groups}] for group-limited routing"
                )
            reachable = num_limited_groups * (num_experts // num_expert_groups)
            if top_k > reachable:
                raise ValueError(
                    f"top_k={top_k} exceeds the {reachable} experts reachable in "
                    f"num_limited_groups={num_limited_groups} groups of "
                    f"{num_experts // num_expert_groups}"
                )
        elif num_limited_groups is not None:
            raise ValueError(
                f"num_limited_groups={num_limited_groups} needs num_expert_groups to be set"
            )
        self.dim = dim
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func: ScoreFunc = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self._debug_force_load_balance = _debug_force_load_balance
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def init_weights(self, init_std: float) -> None:
        """Initialise the gate with a truncated normal of standard deviation ``init_std``."""
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)

    def _limit_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Mask out (with -inf) the experts outside each token's best groups."""
        assert self.num_expert_groups is not None
        assert self.num_limited_groups is not None
        num_tokens = scores_for_choice.shape[0]
        grouped = scores_for_choice.view(num_tokens, self.num_expert_groups, -1)
        best_two = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best_two, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(self.num_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def route(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        """Route ``x`` (``[T, dim]``) and return the full :class:`Routing`."""
        logits = self.gate(x).to(torch.float32)
        if self.score_func == "softmax":
            scores = F.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        # The bias steers the choice only; combine weights come from the unbiased scores.
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        if self.num_expert_groups is not None:
            choice = self._limit_groups(choice)
        if self._debug_force_load_balance:
            first = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * self.top_k
            selected = (first + torch.arange(self.top_k, device=x.device)) % self.num_experts
        else:
            selected = choice.topk(self.top_k, dim=-1).indices
        top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = count_choices(selected, self.num_experts)
        return Routing(scores, top_scores, selected, counts)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x``: ``(top_scores [T, k], selected_experts [T, k], num_tokens_per_expert [E])``.

        Args:
            x: ``[T, dim]`` tokens.
            expert_bias: Optional ``[E]`` bias added to the scores for the choice only.
        """
        routing = self.route(x, expert_bias)
        return routing.top_scores, routing.selected_experts, routing.num_tokens_per_expert


#: Short alias of :class:`TokenChoiceTopKRouter`.
Router = TokenChoiceTopKRouter
