"""The decoder skeleton shared by the MoE families: dense first blocks, then MoE blocks.

A block is the pre-norm transformer block of :mod:`hp_trainer.models.common.decoder` whose
feed-forward is either the dense SwiGLU (``feed_forward``, the first ``n_dense_layers`` blocks)
or hp-cp-ep's :class:`~hp_cp_ep.MoE` (``moe``). The attention module is chosen by the family
(grouped-query attention for Qwen 3 MoE, multi-head latent attention for DeepSeek-V3), so the
two families differ only in their arguments and attention class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from hp_cp_ep import MoE, MoEArgs
from hp_trainer.models.common.attention import AttentionMasks
from hp_trainer.models.common.decoder import (
    Decoder,
    DecoderArgs,
    FeedForward,
    RMSNorm,
    precompute_rope,
)

__all__ = ["MoEBlock", "MoEDecoder", "MoEDecoderArgs"]


@dataclass(kw_only=True)
class MoEDecoderArgs(DecoderArgs):
    """:class:`~hp_trainer.models.common.decoder.DecoderArgs` plus the mixture-of-experts options.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.args.DeepSeekV3ModelArgs` and
        :titan:`torchtitan.models.qwen3.model.args.Qwen3ModelArgs` (their ``moe_args``).
    """

    hf_model_type: ClassVar[str] = "qwen3_moe"
    """The HF ``model_type`` these arguments describe (the one MoE family without its own class)."""

    moe_args: MoEArgs = field(default_factory=MoEArgs)
    """Router, experts and balancing options of every MoE block."""
    moe_hidden_dim: int = 256
    """Hidden size of each routed expert (the shared experts have this times their number)."""
    n_dense_layers: int = 0
    """The first blocks keep a dense SwiGLU (DeepSeek-V3's ``first_k_dense_replace``)."""


class MoEBlock(nn.Module):
    """Pre-norm block whose feed-forward is dense (``feed_forward``) or an MoE (``moe``).

    Args:
        layer_id: Index of the block.
        args: Model arguments.
        attention: The attention module of this block.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.model.TransformerBlock`.
    """

    def __init__(self, layer_id: int, args: MoEDecoderArgs, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_hidden_dim)
        else:
            assert args.ffn_hidden_dim is not None
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """``h = x + attn(norm(x)); h + ffn(norm(h))`` with the dense or MoE feed-forward.

        ``masks`` (the batch's :class:`~hp_trainer.models.common.attention.AttentionMasks`, or
        None for SDPA's causal path) goes to the attention.
        """
        h: torch.Tensor = x + self.attention(self.attention_norm(x), rope, masks=masks)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None
        out: torch.Tensor = h + ffn(self.ffn_norm(h))
        return out

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize norms, attention and the feed-forward (MoE buffers zeroed)."""
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)  # type: ignore[operator]
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            assert self.feed_forward is not None
            self.feed_forward.init_weights(self.weight_init_std)


class MoEDecoder(Decoder):
    """Embedding, dense-then-MoE blocks, final norm and LM head (untied).

    The RoPE table covers ``rope_dim`` (the head size, or MLA's rotary part). Everything else
    (forward, FQNs, weight tying rules) is :class:`~hp_trainer.models.common.decoder.Decoder`'s.

    Args:
        args: Model arguments.
        make_attention: ``make_attention(args) -> nn.Module`` for one block.
        rope_dim: Size of the rotated part of each head.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.model.DeepSeekV3Model`.
    """

    def __init__(
        self,
        args: MoEDecoderArgs,
        make_attention: Callable[[MoEDecoderArgs], nn.Module],
        rope_dim: int,
    ) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.rope_dim = rope_dim
        self.enable_weight_tying = args.enable_weight_tying
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): MoEBlock(i, args, make_attention(args)) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope_cache",
            precompute_rope(rope_dim, args.max_seq_len, args.rope_theta, args.rope_scaling),
            persistent=False,
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter, zero the MoE buffers and recompute the RoPE table.

        Args:
            buffer_device: Device of the buffers (default: where they are, CPU for meta).

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.model.DeepSeekV3Model.init_weights`.
        """
        device = buffer_device or self.rope_cache.device
        if device.type == "meta":
            device = torch.device("cpu")
        args = self.args
        self.rope_cache = precompute_rope(
            self.rope_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
        ).to(device)
        std_emb = 0.02 if self.enable_weight_tying else 1.0
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std_emb)
        for layer in self.layers.values():
            layer.init_weights(device)  # type: ignore[operator]
        self.norm.reset_parameters()
        if not self.enable_weight_tying:
            cutoff = 3.0
            std_out = args.dim**-0.5
            nn.init.trunc_normal_(
                self.lm_head.weight, std=std_out, a=-cutoff * std_out, b=cutoff * std_out
            )

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the *active* parameters (routed experts: top-k of E).

        Args:
            seq_len: Training sequence length.

        Returns:
            ``6 * active non-embedding params + 12 * layers * heads * qk_dim * seq``.

        See Also:
            :titan:`torchtitan.models.utils.get_moe_model_nparams_and_flops`.
        """
        total = sum(p.numel() for p in self.parameters())
        embedding = 0 if self.enable_weight_tying else self.tok_embeddings.weight.numel()
        inactive = 0
        for layer in self.layers.values():
            moe = layer.moe
            if isinstance(moe, MoE):
                per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.num_experts
                inactive += per_expert * (moe.num_experts - moe.top_k)
        head = self.attention_head_dim()
        attn = 12 * self.args.n_layers * self.args.n_heads * head * seq_len
        return 6 * (total - embedding - inactive) + attn

    def attention_head_dim(self) -> int:
        """The query/key size per head (for the attention FLOPs)."""
        assert self.args.head_dim is not None
        return self.args.head_dim
