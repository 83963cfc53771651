"""gpt-oss (``GptOssForCausalLM`` layout): attention with sinks, sliding windows, biased experts.

Every block is an MoE block:

- grouped-query attention with biases in ``wq``/``wk``/``wv``/``wo``, RoPE with YaRN, and one
  learned *sink* logit per head added to every query's softmax denominator; the blocks
  alternate between a sliding window of ``sliding_window`` positions and full causal attention
  (``layer_types``, HF's names);
- a router with a bias whose top-k logits are turned into weights by a softmax over those k
  (the same as the softmax over all experts renormalised over the top k);
- experts with biases and gpt-oss's clamped SwiGLU: the gate is clamped above at ``limit``,
  the up projection to ``[-limit, limit]``, and ``(up + 1) * gate * sigmoid(alpha * gate)``
  goes to the down projection, whose bias is added per chosen expert and weighted like its
  output.

The routed experts subclass hp-cp-ep's :class:`~hp_cp_ep.GroupedExperts` (3-D weights, so the
expert-parallel styles shard them, biases included); the down projection's bias lives next to
the router (:class:`ExpertOutputBias`), where the choices are known, so that tensor-parallel
experts, whose partial outputs are summed over the TP ranks, add it once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_cp_ep import GroupedExperts, MoE, MoEArgs, Routing, TokenChoiceTopKRouter
from hp_cp_ep.cp import context_parallel_attention
from hp_trainer.models.common.attention import AttentionMasks, MaskSpec, attention
from hp_trainer.models.common.decoder import RMSNorm, apply_rope, precompute_rope
from hp_trainer.models.common.moe_decoder import MoEBlock, MoEDecoder, MoEDecoderArgs

__all__ = [
    "LAYER_TYPES",
    "ExpertOutputBias",
    "GptOss",
    "GptOssArgs",
    "GptOssAttention",
    "GptOssExperts",
    "GptOssMoE",
    "GptOssRouter",
    "gpt_oss_routing",
]

logger = logging.getLogger(__name__)

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The values of :attr:`GptOssArgs.layer_types` (HF's ``layer_types`` names)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local block of a parameter (a DTensor under TP / EP), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gpt_oss_routing(num_experts: int, top_k: int, aux_loss_coeff: float = 0.0) -> MoEArgs:
    """gpt-oss's router: softmax over the top ``top_k`` logits, no shared experts.

    Args:
        num_experts: Routed experts (HF's ``num_local_experts``).
        top_k: Experts per token (``num_experts_per_tok``).
        aux_loss_coeff: Weight of the auxiliary load-balancing loss (``router_aux_loss_coef``).

    Returns:
        The routing arguments (softmax scores renormalised over the top k, weights applied to
        the experts' outputs, no routing-bias update).
    """
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        top_k=top_k,
        load_balance_coeff=None,
        aux_loss_coeff=aux_loss_coeff,
    )


@dataclass(kw_only=True)
class GptOssArgs(MoEDecoderArgs):
    """``MoEDecoderArgs`` plus gpt-oss's options.

    Every block is an MoE block (``n_dense_layers`` 0); ``moe_hidden_dim`` is HF's
    ``intermediate_size``.

    Raises:
        ValueError: ``layer_types`` of the wrong length or with an unknown type, a sliding
            layer without a positive ``sliding_window``, dense first blocks, shared experts,
            a capacity factor (gpt-oss is dropless), the fused MoE kernel (plain SwiGLU
            only), or a ``swiglu_limit`` that is not positive.

    See Also:
        ``transformers.GptOssConfig``: the same fields under HF's names.
    """

    hf_model_type: ClassVar[str] = "gpt_oss"

    sliding_window: int | None = 128
    """Positions a sliding-window layer sees (itself included); a window at least as long as
    the sequence is full causal attention."""
    layer_types: tuple[str, ...] | None = None
    """``"sliding_attention"`` or ``"full_attention"`` per block; None: HF's default
    (sliding on even blocks, full on odd ones)."""
    swiglu_alpha: float = 1.702
    """Gain of the sigmoid in the experts' SwiGLU."""
    swiglu_limit: float = 7.0
    """Clamp of the gate (above) and of the up projection (both sides)."""
    attention_bias: bool = True
    """Biases in the query, key, value and output projections."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = tuple(LAYER_TYPES[i % 2] for i in range(self.n_layers))
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for n_layers = {self.n_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} unknown; expected entries of {LAYER_TYPES}")
        sliding = "sliding_attention" in self.layer_types
        if sliding and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(
                f"sliding_window = {self.sliding_window!r} with sliding_attention layers: "
                "expected a positive int"
            )
        if self.n_dense_layers != 0:
            raise ValueError(
                f"gpt-oss has no dense blocks, got n_dense_layers = {self.n_dense_layers}"
            )
        if self.moe_args.num_shared_experts != 0:
            raise ValueError(
                f"gpt-oss has no shared experts, got num_shared_experts = "
                f"{self.moe_args.num_shared_experts}"
            )
        if self.moe_args.capacity_factor is not None:
            raise ValueError(
                f"gpt-oss's MoE is dropless, got capacity_factor = {self.moe_args.capacity_factor}"
            )
        if getattr(self.moe_args, "fused", False):
            raise ValueError(
                "moe_args.fused = True: the fused MoE kernel computes the plain SwiGLU, and "
                "gpt-oss's experts have biases and a clamped SwiGLU; expected fused = False"
            )
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit}")

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of block ``layer_id`` (None: full causal attention)."""
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else None


class GptOssAttention(nn.Module):
    """Grouped-query attention with biases, RoPE, per-head sinks and an optional window.

    Args:
        args: Model arguments.
        layer_id: Index of the block (its ``layer_types`` entry picks the window).

    See Also:
        ``transformers`` ``GptOssAttention``; TorchTitan's gpt-oss model.
    """

    def __init__(self, args: GptOssArgs, layer_id: int) -> None:
        super().__init__()
        assert args.head_dim is not None
        assert args.n_kv_heads is not None
        self.head_dim = args.head_dim
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        #: one learned logit per head in every query's softmax denominator
        self.sinks = nn.Parameter(torch.zeros(args.n_heads))
        window = args.window_of(layer_id)
        #: which keys a query sees: causal, within the window on sliding layers
        self.mask_spec = MaskSpec(sliding_window=window)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, masks: Any = None) -> torch.Tensor:
        """Attend causally (within the window) with the sinks.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table.
            masks: The batch's :class:`~hp_trainer.models.common.attention.AttentionMasks`, or
                the model's per-batch provider of them (``for_length``); None: SDPA, masks
                built per call. Inside a context-parallel step the attention goes to
                hp-cp-ep's engine (``hp_cp_ep.cp.context_parallel_attention``: the
                window, the sinks and the step's documents) instead.

        Returns:
            ``(batch, seq, dim)`` output.
        """
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(B, S, -1, self.head_dim), rope)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sinks = _local(self.sinks)  # this rank's heads under TP
        # inside a context-parallel step: the engine, with the window and the sinks
        out = context_parallel_attention(q, k, v, mask=self.mask_spec, sinks=sinks)
        if out is None:
            if hasattr(masks, "for_length"):
                masks = masks.for_length(S)
            out = attention(q, k, v, spec=self.mask_spec, masks=masks, sinks=sinks)
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        return result

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal projections (``wo`` with ``init_std``), zero biases and sinks."""
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.sinks)


class GptOssRouter(TokenChoiceTopKRouter):
    """gpt-oss's router: a biased gate, softmax over the top-k logits.

    The routing of the last forward is kept in :attr:`last_routing` for
    :class:`GptOssMoE`, which adds the chosen experts' output biases with it.

    Args:
        dim: Model dimension.
        num_experts: Routed experts.
        top_k: Experts per token.

    See Also:
        ``transformers`` ``GptOssTopKRouter``.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__(dim, num_experts, top_k=top_k, score_func="softmax", route_norm=True)
        self.gate = nn.Linear(dim, num_experts, bias=True)
        self.last_routing: Routing | None = None

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal gate weight, zero bias."""
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        assert self.gate.bias is not None
        nn.init.zeros_(self.gate.bias)

    def route(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        """Route ``x`` (``[T, dim]``) and keep the routing for the output biases."""
        routing = super().route(x, expert_bias)
        self.last_routing = routing
        return routing


class GptOssExperts(GroupedExperts):
    """Routed experts with biases and gpt-oss's clamped SwiGLU.

    Expert ``e`` computes ``w2[e] @ ((up + 1) * gate * sigmoid(alpha * gate))`` with
    ``gate = min(w1[e] x + b1[e], limit)`` and ``up = clamp(w3[e] x + b3[e], -limit, limit)``.
    The biases are ``[E, hidden, 1]`` (3-D, like the weights, so hp-cp-ep's expert styles
    shard them on the expert and hidden dimensions); the down projection's bias is
    :class:`ExpertOutputBias`'s. Rows are computed one expert at a time (one host read of
    the counts when the dispatch did not read them, as :class:`~hp_cp_ep.GroupedExperts`'s
    per-expert loop does).

    Args:
        dim: Model dimension.
        hidden_dim: Hidden size of each expert (HF's ``intermediate_size``).
        num_experts: Routed experts.
        alpha: Keyword-only; gain of the sigmoid.
        limit: Keyword-only; clamp of the gate and up projections.

    See Also:
        ``transformers`` ``GptOssExperts``; :class:`hp_cp_ep.GroupedExperts`.
    """

    hidden_dim_of_weight: ClassVar[dict[str, int]] = {"w1": 1, "w2": 2, "w3": 1, "b1": 1, "b3": 1}

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, *, alpha: float, limit: float
    ) -> None:
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm=False)
        self.alpha = alpha
        self.limit = limit
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden_dim, 1))
        self.b3 = nn.Parameter(torch.zeros(num_experts, hidden_dim, 1))

    def init_weights(self, init_std: float) -> None:
        """The weights as :class:`~hp_cp_ep.GroupedExperts`'s, zero biases."""
        super().init_weights(init_std)
        for name in ("b1", "b3"):
            bias = getattr(self, name, None)  # None while the base class initializes
            if bias is not None:
                nn.init.zeros_(bias)

    def _expert(self, rows: torch.Tensor, e: int, weights: list[torch.Tensor]) -> torch.Tensor:
        w1, w2, w3, b1, b3 = weights
        gate = (rows @ w1[e].t() + b1[e, :, 0]).clamp(max=self.limit)
        up = (rows @ w3[e].t() + b3[e, :, 0]).clamp(min=-self.limit, max=self.limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out: torch.Tensor = hidden @ w2[e].t()
        return out

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
            sizes: The same counts as Python ints when already known on the host.

        Raises:
            ValueError: A count per expert that does not match the experts held here.
        """
        weights = [_local(p) for p in (self.w1, self.w2, self.w3, self.b1, self.b3)]
        local_weights = getattr(self.token_dispatcher, "local_weights", None)
        if local_weights is not None:  # hot-expert replicas: own experts, then the replicas
            weights = list(local_weights(*weights))
        weights = [w.to(x.dtype) for w in weights]
        if num_tokens_per_expert.numel() != weights[0].shape[0]:
            raise ValueError(
                f"num_tokens_per_expert has {num_tokens_per_expert.numel()} entries but this "
                f"rank holds {weights[0].shape[0]} experts"
            )
        if sizes is None:  # a host read: the split needs the counts on the host
            sizes = [int(n) for n in num_tokens_per_expert.tolist()]
        outputs = [
            self._expert(rows, e, weights)
            for e, rows in enumerate(torch.split(x, sizes, dim=0))
            if rows.shape[0] > 0
        ]
        if not outputs:  # no rows: an empty product still linked to x and the weights
            return self._expert(x[:0], 0, weights)
        return torch.cat(outputs, dim=0)


class ExpertOutputBias(nn.Module):
    """The experts' down-projection biases, added per choice with the routing weights.

    ``out[t] = sum_j w[t, j] * bias[e[t, j]]`` for the ``k`` choices of token ``t``: the bias
    term of ``sum_j w[t, j] * expert_{e[t, j]}(x_t)``.

    Args:
        num_experts: Routed experts.
        dim: Model dimension.
    """

    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))

    def forward(self, top_scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """``[T, dim]`` bias term of the routing ``top_scores`` / ``selected`` (``[T, k]``)."""
        weight = _local(self.weight)
        scores, chosen = _local(top_scores), _local(selected)
        return (scores.unsqueeze(-1).to(weight.dtype) * weight[chosen]).sum(dim=1)


class GptOssMoE(MoE):
    """hp-cp-ep's :class:`~hp_cp_ep.MoE` with gpt-oss's router, experts and output biases.

    Args:
        moe_args: Routing options (:func:`gpt_oss_routing`).
        dim: Model dimension.
        hidden_dim: Hidden size of each expert.
        alpha: Keyword-only; the SwiGLU's sigmoid gain.
        limit: Keyword-only; the SwiGLU's clamp.

    See Also:
        ``transformers`` ``GptOssMLP``.
    """

    def __init__(
        self, moe_args: MoEArgs, dim: int, hidden_dim: int, *, alpha: float, limit: float
    ) -> None:
        super().__init__(moe_args, dim, hidden_dim)
        self.router = GptOssRouter(dim, moe_args.num_experts, moe_args.top_k)
        self.experts = GptOssExperts(
            dim, hidden_dim, moe_args.num_experts, alpha=alpha, limit=limit
        )
        self.expert_output_bias = ExpertOutputBias(moe_args.num_experts, dim)

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Router, experts and buffers as :class:`~hp_cp_ep.MoE`'s; zero output biases."""
        super().init_weights(init_std, buffer_device)
        nn.init.zeros_(self.expert_output_bias.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus their weighted down-projection biases."""
        out = super().forward(x)
        router: Any = self.router
        routing: Routing = router.last_routing
        router.last_routing = None
        bias = self.expert_output_bias(routing.top_scores, routing.selected_experts)
        result: torch.Tensor = out + bias.reshape(out.shape).to(out.dtype)
        return result


class _BatchMasks:
    """The masks of one batch, one :class:`AttentionMasks` per sequence length attended.

    Built by the model before its first block and shared by all of them; the attention asks
    for its sequence length (the whole sequence under sequence parallelism, where the blocks'
    residual stream holds a shard of it), so each spec is lowered once per batch.
    """

    def __init__(
        self, model: GptOss, batch: int, document_ids: torch.Tensor | None, device: Any
    ) -> None:
        self.model = model
        self.batch = batch
        self.document_ids = document_ids
        self.device = device
        self._by_length: dict[int, AttentionMasks] = {}

    def for_length(self, seq: int) -> AttentionMasks:
        """The batch's masks for ``seq`` positions (built at the first request)."""
        masks = self._by_length.get(seq)
        if masks is None:
            self.model._say_window(seq)
            masks = AttentionMasks(
                self.model.args.attn_backend,
                seq,
                batch_size=self.batch,
                document_ids=self.document_ids,
                device=self.device,
            )
            self._by_length[seq] = masks
        return masks


class _GptOssBlock(MoEBlock):
    """Pre-norm block: gpt-oss attention and MoE (forward and init: ``MoEBlock``'s)."""

    def __init__(self, layer_id: int, args: GptOssArgs) -> None:
        nn.Module.__init__(self)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GptOssAttention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = True
        self.feed_forward = None
        self.moe = GptOssMoE(
            args.moe_args,
            args.dim,
            args.moe_hidden_dim,
            alpha=args.swiglu_alpha,
            limit=args.swiglu_limit,
        )
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)


class GptOss(MoEDecoder):
    """The gpt-oss decoder: embedding, MoE blocks with sink attention, final norm, LM head.

    Args:
        args: Model arguments (a ``gpt_oss_flavors``
            entry).

    See Also:
        HF's ``GptOssForCausalLM`` (``transformers``); TorchTitan's gpt-oss model.
    """

    args: GptOssArgs

    def __init__(self, args: GptOssArgs) -> None:
        nn.Module.__init__(self)
        assert args.head_dim is not None
        self.args = args
        self.rope_dim = args.head_dim
        self.enable_weight_tying = args.enable_weight_tying
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): _GptOssBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope_cache",
            precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling),
            persistent=False,
        )
        self._window_said = False

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits (as :meth:`hp_trainer.Decoder.forward`).

        The batch's masks are built once and shared by every block: the sliding layers' window
        mask is lowered once per batch for the backend (SDPA: one dense mask; FlexAttention: a
        block mask; varlen: windowed segments).

        Args:
            tokens: ``(batch, seq)`` token ids (hidden states in later pipeline stages).
            document_ids: Keyword-only; ``(batch, seq)`` document ids of packed samples.

        Returns:
            ``(batch, seq, vocab)`` logits.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        masks = _BatchMasks(self, h.shape[0], document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, masks=masks)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h  # type: ignore[no-any-return]

    def _say_window(self, seq: int) -> None:
        window = self.args.sliding_window
        sliding = "sliding_attention" in (self.args.layer_types or ())
        if not self._window_said and sliding and window is not None and window >= seq:
            logger.info(
                "gpt-oss: sliding_window %d >= sequence length %d: the sliding layers attend "
                "to the whole causal past (full attention)",
                window,
                seq,
            )
            self._window_said = True

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the active parameters, sliding windows counted.

        ``6 * (non-embedding params - the k-unchosen experts' share)`` plus the attention
        ``12 * heads * head_dim * sum_layers context``, where a block's context is
        ``min(seq_len, sliding_window)`` on a sliding layer and ``seq_len`` on a full one.

        Args:
            seq_len: Training sequence length.

        Returns:
            FLOPs per token (forward + backward).
        """
        args = self.args
        total = sum(p.numel() for p in self.parameters())
        embedding = 0 if self.enable_weight_tying else self.tok_embeddings.weight.numel()
        inactive = 0
        for layer in self.layers.values():
            moe = layer.moe
            if isinstance(moe, GptOssMoE):
                routed = sum(p.numel() for p in moe.experts.parameters())
                routed += moe.expert_output_bias.weight.numel()
                inactive += routed // moe.num_experts * (moe.num_experts - moe.top_k)
        assert args.head_dim is not None
        context = 0
        for i in range(args.n_layers):
            window = args.window_of(i)
            context += seq_len if window is None else min(seq_len, window)
        attn = 12 * args.n_heads * args.head_dim * context
        return 6 * (total - embedding - inactive) + attn
