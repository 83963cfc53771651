"""Qwen3.5 (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``): the Gated DeltaNet hybrid.

Blocks follow ``layer_types``: most are *linear attention* (:class:`GatedDeltaNet`: projections,
a causal depthwise conv, the gated delta rule, a gated RMSNorm), every few a *full attention*
(:class:`GatedAttention`: grouped-query attention with QK-norm, rotary embeddings on the first
``partial_rotary_factor`` of each head, and a sigmoid output gate per channel). The
feed-forward is a SwiGLU (dense flavor) or routed experts plus one shared expert whose output
is scaled by a learned sigmoid gate (MoE flavor). Norms of the residual stream and the QK-norms
scale by ``1 + weight`` (weights start at zero), as in ``transformers``.

Layouts are ``transformers``' (rotary halves, not interleaved pairs), so an HF checkpoint maps
by renaming and splitting the fused ``in_proj_qkv`` / conv into query, key and value parts
(which lets tensor parallelism split heads of the three consistently).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hp_cp_ep import MoE, MoEArgs
from hp_trainer.models.common.attention import AttentionMasks, MaskSpec, attention
from hp_trainer.models.common.decoder import (
    Decoder,
    DecoderArgs,
    FeedForward,
    RMSNorm,
    precompute_rope,
)
from hp_trainer.models.qwen3_5.delta_rule import (
    causal_depthwise_conv,
    delta_rule_flops_per_token,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "GatedAttention",
    "GatedDeltaNet",
    "Qwen35",
    "Qwen35Args",
    "Qwen35Block",
    "Qwen35Moe",
    "Qwen35MoeArgs",
    "SharedExpertMoE",
    "ZeroCenteredRMSNorm",
    "apply_partial_rotary",
    "hybrid_layer_types",
    "qwen3_5_moe_routing",
]

LINEAR_ATTENTION = "linear_attention"
"""``layer_types`` entry of a Gated DeltaNet block."""
FULL_ATTENTION = "full_attention"
"""``layer_types`` entry of a gated full-attention block."""


def hybrid_layer_types(n_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """Qwen3.5's schedule: every ``full_attention_interval``-th block is full attention.

    Args:
        n_layers: Number of blocks.
        full_attention_interval: Blocks per full-attention block (HF's default 4).

    Returns:
        ``layer_types``, e.g. ``(linear, linear, linear, full, ...)``.

    Raises:
        ValueError: A non-positive interval.
    """
    if full_attention_interval < 1:
        raise ValueError(f"full_attention_interval must be >= 1, got {full_attention_interval}")
    return tuple(
        FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION
        for i in range(n_layers)
    )


@dataclass(kw_only=True)
class Qwen35Args(DecoderArgs):
    """:class:`~hp_trainer.DecoderArgs` plus Qwen3.5's hybrid options.

    ``n_heads`` / ``n_kv_heads`` / ``head_dim`` describe the full-attention blocks, the
    ``linear_*`` fields the Gated DeltaNet blocks.

    See Also:
        ``transformers.Qwen3_5TextConfig``: the HF fields of the same names.
    """

    hf_model_type: ClassVar[str] = "qwen3_5_text"
    """The HF ``model_type`` these arguments describe."""

    qk_norm: bool = True
    """Qwen3.5's full attention always normalizes queries and keys per head."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    partial_rotary_factor: float = 0.25
    """Fraction of each full-attention head that is rotated (the first dimensions)."""
    layer_types: tuple[str, ...] | None = None
    """``linear_attention`` / ``full_attention`` per block (None: every fourth is full)."""
    linear_conv_kernel_dim: int = 4
    """Taps of the causal depthwise convolution."""
    linear_num_key_heads: int = 16
    """Query/key heads of the Gated DeltaNet blocks."""
    linear_num_value_heads: int = 32
    """Value heads (a multiple of the key heads; each key head serves a group)."""
    linear_key_head_dim: int = 128
    """Query/key head size of the Gated DeltaNet blocks."""
    linear_value_head_dim: int = 128
    """Value head size of the Gated DeltaNet blocks."""
    linear_chunk_size: int = field(default=64, compare=False)
    """Tokens per chunk of the chunked delta rule (training form; any value gives the same
    result, so it is not compared with a checkpoint's config.json)."""
    linear_recurrent: bool = field(default=False, compare=False)
    """Run the delta rule token by token instead (the reference form; slow)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = hybrid_layer_types(self.n_layers)
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= {
            LINEAR_ATTENTION,
            FULL_ATTENTION,
        }:
            raise ValueError(
                f"layer_types must give '{LINEAR_ATTENTION}' or '{FULL_ATTENTION}' for each of "
                f"the {self.n_layers} blocks, got {self.layer_types}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                f"= {self.rotary_dim} rotary dimensions: expected an even number >= 2"
            )
        if self.linear_chunk_size < 1:
            raise ValueError(f"linear_chunk_size must be >= 1, got {self.linear_chunk_size}")

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions of each full-attention head (HF's ``int(head_dim * factor)``)."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)


def qwen3_5_moe_routing(num_experts: int, top_k: int) -> MoEArgs:
    """Qwen3.5 MoE's router: softmax over the experts, top ``top_k`` renormalized, no bias.

    Args:
        num_experts: Routed experts.
        top_k: Experts per token.

    Returns:
        The routing arguments (the shared expert is :class:`SharedExpertMoE`'s own).
    """
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        top_k=top_k,
        load_balance_coeff=None,
    )


@dataclass(kw_only=True)
class Qwen35MoeArgs(Qwen35Args):
    """Qwen3.5 arguments with routed experts and a gated shared expert in every block.

    :class:`~hp_trainer.models.qwen3_5.model.Qwen35Args` plus the MoE options.

    See Also:
        ``transformers.Qwen3_5MoeTextConfig``.
    """

    hf_model_type: ClassVar[str] = "qwen3_5_moe_text"
    """The HF ``model_type`` these arguments describe."""

    moe_args: MoEArgs = field(default_factory=lambda: qwen3_5_moe_routing(8, 2))
    """Router and experts of every block."""
    moe_hidden_dim: int = 256
    """Hidden size of each routed expert."""
    shared_expert_hidden_dim: int = 256
    """Hidden size of the shared expert."""
    n_dense_layers: int = 0
    """Always 0, every Qwen3.5 MoE block routes (kept for the MoE layout checks)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_dense_layers != 0:
            raise ValueError(
                f"n_dense_layers must be 0 (every Qwen3.5 MoE block routes), got "
                f"{self.n_dense_layers}"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's local shard (its gradient flows back into the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` (weight starts at zero), computed in float32.

    Args:
        dim: Normalized (last) dimension.
        eps: Added to the mean square.

    See Also:
        :pt:`torch.nn.RMSNorm`; ``transformers``' ``Qwen3_5RMSNorm``.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` over its last dimension and scale by ``1 + weight``."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        """Set the weight to zeros (a scale of one)."""
        nn.init.zeros_(self.weight)


def apply_partial_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * rope.shape[1]`` dimensions of each head, halves convention.

    Dimension ``i`` pairs with ``i + r / 2`` (``r`` rotated dimensions, HF's ``rotate_half``);
    the remaining ``head_dim - r`` dimensions pass through.

    Args:
        x: ``(batch, seq, heads, head_dim)``.
        rope: ``(>= seq, r / 2, 2)`` cosine/sine table from
            :func:`~hp_trainer.models.common.decoder.precompute_rope` with ``head_dim = r``.

    Returns:
        The rotated tensor, in ``x``'s dtype.

    See Also:
        ``transformers.models.qwen3_5.modeling_qwen3_5.apply_rotary_pos_emb``.
    """
    seq = x.shape[1]
    half = rope.shape[1]
    cos = rope[:seq, :, 0].view(1, seq, 1, half)
    sin = rope[:seq, :, 1].view(1, seq, 1, half)
    xf = x.float()
    first, second, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    out = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    return out.type_as(x)


class GatedAttention(nn.Module):
    """Grouped-query attention with QK-norm, partial rotary and a sigmoid output gate.

    ``wq`` projects to ``2 * head_dim`` per head: the query, then the gate of that head's
    output channels (so a column-sharded ``wq`` keeps each head's query and gate together).

    Args:
        args: Model arguments.

    See Also:
        ``transformers``' ``Qwen3_5Attention``.
    """

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        assert args.head_dim is not None
        assert args.n_kv_heads is not None
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * 2, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        #: which keys a query sees (documents come per batch)
        self.mask_spec = MaskSpec()

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """Attend causally; gate the output channels by ``sigmoid(gate)``.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: Rotary table of the rotated dimensions.
            masks: The batch's masks (None: SDPA's causal path).

        Returns:
            ``(batch, seq, dim)`` output.
        """
        B, S, _ = x.shape
        D = self.head_dim
        qg = self.wq(x).view(B, S, -1, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        q = apply_partial_rotary(self.q_norm(q), rope)
        k = apply_partial_rotary(self.k_norm(self.wk(x).view(B, S, -1, D)), rope)
        v = self.wv(x).view(B, S, -1, D)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            spec=self.mask_spec,
            masks=masks,
        )
        out = out.transpose(1, 2).reshape(B, S, -1) * torch.sigmoid(gate.reshape(B, S, -1))
        result: torch.Tensor = self.wo(out)
        return result

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal projections (``wo`` with ``init_std``), norms at zero."""
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: short causal conv, gated delta rule, gated RMSNorm.

    Queries, keys and values are projected (``wq``, ``wk``, ``wv``; HF fuses them in
    ``in_proj_qkv``), each passed through SiLU of a causal depthwise convolution (``conv_q``,
    ``conv_k``, ``conv_v``: ``(channels, taps)``), then mixed by the gated delta rule with write
    strength ``beta = sigmoid(wb x)`` and log decay
    ``g = -exp(A_log) * softplus(wa x + dt_bias)`` per value head. The output is RMS-normalized
    per head, multiplied by ``silu(wz x)`` and projected back by ``wo``.

    Every parameter but ``norm`` (one scale shared by the heads) is laid out by heads or by
    their channels along dimension 0, so tensor parallelism shards all of them on dimension 0
    (:func:`~hp_trainer.parallelize_qwen3_5`).

    Args:
        args: Model arguments.

    See Also:
        ``transformers``' ``Qwen3_5GatedDeltaNet``; Yang et al., "Gated Delta Networks".
    """

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        self.key_dim = args.linear_key_head_dim
        self.value_dim = args.linear_value_head_dim
        self.chunk_size = args.linear_chunk_size
        self.recurrent = args.linear_recurrent
        keys = args.linear_num_key_heads * self.key_dim
        values = args.linear_num_value_heads * self.value_dim
        heads = args.linear_num_value_heads
        taps = args.linear_conv_kernel_dim
        self.wq = nn.Linear(args.dim, keys, bias=False)
        self.wk = nn.Linear(args.dim, keys, bias=False)
        self.wv = nn.Linear(args.dim, values, bias=False)
        self.wz = nn.Linear(args.dim, values, bias=False)
        self.wb = nn.Linear(args.dim, heads, bias=False)
        self.wa = nn.Linear(args.dim, heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(keys, taps))
        self.conv_k = nn.Parameter(torch.empty(keys, taps))
        self.conv_v = nn.Parameter(torch.empty(values, taps))
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = RMSNorm(self.value_dim, eps=args.norm_eps)
        self.wo = nn.Linear(values, args.dim, bias=False)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mix the sequence causally.

        Args:
            x: ``(batch, seq, dim)`` input (the whole sequence: the state runs from its start).
            document_ids: ``(batch, seq)`` document of each position of packed samples: the
                conv and the state restart at every document (None: one sequence).

        Returns:
            ``(batch, seq, dim)`` output.
        """
        B, S, _ = x.shape
        docs = document_ids

        def conv(t: torch.Tensor, weight: torch.Tensor, size: int) -> torch.Tensor:
            return causal_depthwise_conv(t, _local(weight), document_ids=docs).view(B, S, -1, size)

        q = conv(self.wq(x), self.conv_q, self.key_dim)
        k = conv(self.wk(x), self.conv_k, self.key_dim)
        v = conv(self.wv(x), self.conv_v, self.value_dim)
        beta = torch.sigmoid(self.wb(x))
        g = -_local(self.A_log).float().exp() * F.softplus(
            self.wa(x).float() + _local(self.dt_bias)
        )
        if self.recurrent:
            out, _ = gated_delta_rule_recurrent(q, k, v, g, beta, document_ids=docs)
        else:
            out, _ = gated_delta_rule_chunked(
                q, k, v, g, beta, chunk_size=self.chunk_size, document_ids=docs
            )
        z = self.wz(x).view(B, S, -1, self.value_dim)
        out = (self.norm(out) * F.silu(z.float())).type_as(x)
        result: torch.Tensor = self.wo(out.reshape(B, S, -1))
        return result

    def init_weights(self, init_std: float) -> None:
        """Projections truncated-normal, conv uniform (``1/sqrt(taps)``), decays as HF's init.

        ``A = exp(A_log)`` is drawn uniformly from ``[0.01, 16]``; ``dt_bias`` is one.
        """
        for lin in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        bound = 1.0 / math.sqrt(self.conv_q.shape[-1])
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.uniform_(conv, -bound, bound)
        nn.init.ones_(self.dt_bias)
        nn.init.uniform_(self.A_log, 0.01, 16.0)
        self.A_log.log_()
        self.norm.reset_parameters()


class SharedExpertMoE(MoE):
    """hp-cp-ep's :class:`~hp_cp_ep.MoE` plus one shared SwiGLU expert scaled by a sigmoid gate.

    ``out = routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen3.5 MoE's
    sparse block; the gate is one scalar per token).

    Args:
        moe_args: Router and expert options (no shared experts of the base class).
        dim: Model dimension.
        hidden_dim: Hidden size of each routed expert.
        shared_hidden_dim: Hidden size of the shared expert.

    See Also:
        ``transformers``' ``Qwen3_5MoeSparseMoeBlock``.
    """

    def __init__(
        self, moe_args: MoEArgs, dim: int, hidden_dim: int, shared_hidden_dim: int
    ) -> None:
        super().__init__(dataclasses.replace(moe_args, num_shared_experts=0), dim, hidden_dim)
        self.shared_expert = FeedForward(dim, shared_hidden_dim)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts plus the gated shared expert."""
        routed = super().forward(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out: torch.Tensor = routed + shared
        return out

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Initialize the routed part, the shared expert and its gate."""
        super().init_weights(init_std, buffer_device)
        self.shared_expert.init_weights(init_std)
        nn.init.trunc_normal_(self.shared_expert_gate.weight, mean=0.0, std=0.02)


class Qwen35Block(nn.Module):
    """Pre-norm block: Gated DeltaNet or gated attention, then SwiGLU or the MoE.

    Args:
        layer_id: Index of the block.
        args: Model arguments (:class:`Qwen35MoeArgs`: an MoE feed-forward).

    See Also:
        ``transformers``' ``Qwen3_5DecoderLayer``.
    """

    def __init__(self, layer_id: int, args: Qwen35Args) -> None:
        super().__init__()
        assert args.layer_types is not None
        self.layer_type = args.layer_types[layer_id]
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.attention: GatedAttention | None = None
        self.linear_attention: GatedDeltaNet | None = None
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attention = GatedDeltaNet(args)
        else:
            self.attention = GatedAttention(args)
        self.feed_forward: FeedForward | None = None
        self.moe: SharedExpertMoE | None = None
        if isinstance(args, Qwen35MoeArgs):
            self.moe = SharedExpertMoE(
                args.moe_args, args.dim, args.moe_hidden_dim, args.shared_expert_hidden_dim
            )
        else:
            assert args.ffn_hidden_dim is not None
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.moe_enabled = self.moe is not None
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """``h = x + mix(norm(x)); h + ffn(norm(h))``."""
        normed = self.attention_norm(x)
        if self.linear_attention is not None:
            docs = masks.document_ids if masks is not None else None
            mixed = self.linear_attention(normed, document_ids=docs)
        else:
            assert self.attention is not None
            mixed = self.attention(normed, rope, masks=masks)
        h: torch.Tensor = x + mixed
        ffn: nn.Module | None = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None
        out: torch.Tensor = h + ffn(self.ffn_norm(h))
        return out

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize norms (zeros: scale one), the token mixer and the feed-forward."""
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        mixer: Any = self.linear_attention if self.linear_attention is not None else self.attention
        mixer.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            assert self.feed_forward is not None
            self.feed_forward.init_weights(self.weight_init_std)


class Qwen35(Decoder):
    """The Qwen3.5 decoder (dense flavor; :class:`~hp_trainer.Qwen35Moe` for the MoE one).

    Embedding, a ``ModuleDict`` of ``Qwen35Block`` (``"0"``, ``"1"``, ...), a final
    zero-centered RMSNorm and the LM head; the rotary table covers the rotated dimensions only.

    Args:
        args: Model arguments (a ``qwen3_5_flavors``
            entry).

    See Also:
        ``transformers.Qwen3_5ForCausalLM``; HyperParallel's ``parallelize_qwen3_5`` recipe
        (:func:`~hp_trainer.parallelize_qwen3_5` here).
    """

    args: Qwen35Args

    def __init__(self, args: Qwen35Args) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.enable_weight_tying = args.enable_weight_tying
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Qwen35Block(i, args) for i in range(args.n_layers)})
        self.norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)  # type: ignore[assignment]
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._rope(), persistent=False)

    def _rope(self) -> torch.Tensor:
        a = self.args
        return precompute_rope(a.rotary_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: ``(batch, seq)`` token ids (or hidden states in a later pipeline stage).
            document_ids: Keyword-only; ``(batch, seq)`` document of each position of packed
                samples: full attention stays inside each document (block-causal) and the
                Gated DeltaNet blocks restart their conv and state at every document (RoPE
                positions do not restart). None: one sequence per row.

        Returns:
            ``(batch, seq, vocab)`` logits.

        See Also:
            :meth:`hp_trainer.Decoder.forward`.
        """
        return super().forward(tokens, document_ids=document_ids)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and recompute the rotary table.

        Args:
            buffer_device: Device of the buffers (default: where they are, CPU for meta).
        """
        device = buffer_device or self.rope_cache.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.rope_cache = self._rope().to(device)
        if self.tok_embeddings is not None:
            std = 0.02 if self.enable_weight_tying else 1.0
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            layer.init_weights(device)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.enable_weight_tying and self.lm_head is not None:
            std_out = self.args.dim**-0.5
            nn.init.trunc_normal_(self.lm_head.weight, std=std_out, a=-3 * std_out, b=3 * std_out)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: parameters, full attention and the delta rule.

        ``6 * active non-embedding parameters`` (routed experts: top-k of E), plus
        ``12 * heads * head_dim * seq_len`` per full-attention block, plus
        :func:`~hp_trainer.models.qwen3_5.delta_rule.delta_rule_flops_per_token` per Gated
        DeltaNet block.

        Args:
            seq_len: Training sequence length.

        Returns:
            FLOPs per token (forward + backward).

        See Also:
            :titan:`torchtitan.models.utils.get_dense_model_nparams_and_flops`.
        """
        a = self.args
        total = sum(p.numel() for p in self.parameters())
        embedding = 0 if self.enable_weight_tying else self.tok_embeddings.weight.numel()
        inactive = 0
        for layer in self.layers.values():
            moe = getattr(layer, "moe", None)
            if isinstance(moe, MoE):
                per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.num_experts
                inactive += per_expert * (moe.num_experts - moe.top_k)
        assert a.layer_types is not None
        assert a.head_dim is not None
        full = a.layer_types.count(FULL_ATTENTION)
        linear = a.layer_types.count(LINEAR_ATTENTION)
        mixing = full * 12 * a.n_heads * a.head_dim * seq_len + linear * (
            delta_rule_flops_per_token(
                a.linear_num_value_heads,
                a.linear_key_head_dim,
                a.linear_value_head_dim,
                a.linear_chunk_size,
                seq_len,
            )
        )
        return 6 * (total - embedding - inactive) + mixing


class Qwen35Moe(Qwen35):
    """The Qwen3.5 MoE decoder: :class:`~hp_trainer.Qwen35` with ``SharedExpertMoE`` feed-forwards.

    Args:
        args: Model arguments (a
            ``qwen3_5_moe_flavors`` entry).

    See Also:
        ``transformers.Qwen3_5MoeForCausalLM``.
    """

    args: Qwen35MoeArgs

    def __init__(self, args: Qwen35MoeArgs) -> None:
        if not isinstance(args, Qwen35MoeArgs):
            raise TypeError(f"Qwen35Moe needs Qwen35MoeArgs, got {type(args).__name__}")
        super().__init__(args)
