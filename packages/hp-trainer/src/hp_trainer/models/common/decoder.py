"""A dense decoder-only transformer (Llama 3 / Qwen 3 family) written for parallelism from outside.

The model code is single-device code: tensor parallelism, FSDP, activation checkpointing and
compile are applied by the ``parallelize`` functions. Attention derives the number of local heads
from the projected tensor, so a column-sharded ``wq``/``wk``/``wv`` just works under TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hp_trainer.models.common.attention import (
    ATTENTION_BACKENDS,
    AttentionMasks,
    MaskSpec,
    attention,
)

__all__ = [
    "Attention",
    "Decoder",
    "DecoderArgs",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "YarnRopeScaling",
    "compute_ffn_hidden_dim",
    "precompute_rope",
]


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF ``rope_type: "llama3"``).

    Frequencies whose wavelength is shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept, those longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``, and the band in between is interpolated
    linearly (in ``original_max_position_embeddings / wavelength``) between the two.

    See Also:
        :titan:`torchtitan.models.llama3.model.args.RoPEScalingArgs`: TorchTitan's scaling args.
    """

    factor: float = 8.0
    """How much longer the context is than the one the model was pre-trained on."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """The pre-training context length."""

    def __post_init__(self) -> None:
        # equal factors (Llama 4 Scout) make the band empty: a step at the context length
        if self.factor < 1.0 or self.high_freq_factor < self.low_freq_factor:
            raise ValueError(
                f"invalid RopeScaling {self}: expected factor >= 1 and "
                "high_freq_factor >= low_freq_factor"
            )

    def scale(self, freqs: torch.Tensor) -> torch.Tensor:
        """Scale inverse frequencies (radians per position).

        Args:
            freqs: ``(head_dim // 2,)`` float32 inverse frequencies.

        Returns:
            The scaled frequencies.

        See Also:
            ``transformers.modeling_rope_utils``: HF's ``llama3`` rope type.
        """
        context = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / freqs
        # 0 for long wavelengths (fully scaled), 1 for short ones (kept), linear in between
        band = self.high_freq_factor - self.low_freq_factor
        if band == 0.0:  # no band: a step
            keep = (context / wavelength > self.low_freq_factor).to(freqs.dtype)
        else:
            keep = ((context / wavelength - self.low_freq_factor) / band).clamp(0.0, 1.0)
        return (1 - keep) * freqs / self.factor + keep * freqs


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # YaRN's magnitude correction for a context ``factor`` times longer (1 when not longer)
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN context extension (HF ``rope_type: "yarn"``): DeepSeek-V3, gpt-oss, Qwen.

    Rotary dimensions that turn many times over the pre-training context keep their frequency
    (extrapolation), those that turn less than once are divided by ``factor``
    (interpolation), and a linear ramp over the dimension index blends the two between the
    dimensions that turn ``beta_fast`` and ``beta_slow`` times. The cosine/sine table is
    multiplied by :attr:`cos_sin_scale` (the paper's magnitude correction), and models with
    ``mscale_all_dim`` (DeepSeek's latent attention) also multiply their softmax scale by
    :attr:`softmax_scale_factor`.

    See Also:
        ``transformers.modeling_rope_utils``: HF's ``yarn`` rope type (the oracle of the tests).
    """

    factor: float
    """How much longer the context is than the one the model was pre-trained on."""
    original_max_position_embeddings: int
    """The pre-training context length."""
    beta_fast: float = 32.0
    """Dimensions turning more than this many times over the context are kept."""
    beta_slow: float = 1.0
    """Dimensions turning fewer than this many times are fully interpolated."""
    mscale: float | None = None
    """Magnitude-correction multiplier of the cosine/sine table (with ``mscale_all_dim``)."""
    mscale_all_dim: float | None = None
    """The same for every query/key dimension; it divides the table's correction and multiplies
    the softmax scale (squared) of models that apply it (DeepSeek-V3)."""
    attention_factor: float | None = None
    """Explicit cosine/sine scale, or None to derive it from ``factor``, ``mscale`` and
    ``mscale_all_dim``."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (HF's default)."""

    def __post_init__(self) -> None:
        if self.factor < 1.0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                f"invalid YarnRopeScaling {self}: expected factor >= 1 and "
                "original_max_position_embeddings >= 1"
            )

    @property
    def cos_sin_scale(self) -> float:
        """The factor the cosine/sine table is multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Multiplier of the softmax scale for models that apply ``mscale_all_dim``."""
        if not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def frequencies(self, head_dim: int, theta: float) -> torch.Tensor:
        """The scaled inverse frequencies of the rotary dimensions.

        Args:
            head_dim: Rotary size of a head (even).
            theta: RoPE base frequency.

        Returns:
            ``(head_dim // 2,)`` float32 inverse frequencies (radians per position).
        """
        base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        kept = 1.0 / base
        scaled = 1.0 / (self.factor * base)
        context = self.original_max_position_embeddings

        def dim_turning(turns: float) -> float:
            # the rotary dimension whose wavelength fits ``turns`` times in the context
            return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_turning(self.beta_fast), dim_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a step instead of a ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return scaled * (1 - keep) + kept * keep


@dataclass(kw_only=True)
class DecoderArgs:
    """Shape and options of a :class:`Decoder`.

    See Also:
        :titan:`torchtitan.models.llama3.model.args.TransformerModelArgs`: TorchTitan's model args.
    """

    dim: int = 256
    """Hidden size."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 16
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None means ``n_heads``)."""
    head_dim: int | None = None
    """Per-head size (None means ``dim // n_heads``)."""
    vocab_size: int = 2048
    """Vocabulary size (embedding rows, logits columns)."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Optional multiplier of the SwiGLU hidden size."""
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden size (overrides the Llama rule; Qwen 3 style)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | YarnRopeScaling | None = None
    """Llama 3.1-style RoPE scaling, YaRN, or None for plain RoPE (Llama 3.0, Qwen 3)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table covers."""
    qk_norm: bool = False
    """RMS-normalize queries and keys per head before RoPE (Qwen 3)."""
    enable_weight_tying: bool = False
    """Share the embedding matrix with the output projection."""
    depth_init: bool = True
    """Scale output-projection init by the layer index (TorchTitan's depth init)."""
    attn_backend: str = "sdpa"
    """The attention kernel, ``sdpa``, ``flex`` or ``varlen``
    (``hp_trainer.models.common.attention``; TorchTitan's ``attn_backend``)."""

    def __post_init__(self) -> None:
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attn_backend must be one of {ATTENTION_BACKENDS}, got {self.attn_backend!r}"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


def compute_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden size: ``2/3 * 4 * dim``, scaled, rounded up to ``multiple_of``.

    Args:
        dim: Model hidden size.
        multiple_of: Rounding granularity.
        ffn_dim_multiplier: Optional extra multiplier.

    Returns:
        The hidden size.

    See Also:
        :titan:`torchtitan.models.common.feed_forward.compute_ffn_hidden_dim`: TorchTitan's rule.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | YarnRopeScaling | None = None,
) -> torch.Tensor:
    """Cosine/sine table for rotary embeddings, shape ``(max_seq_len, head_dim // 2, 2)``.

    Args:
        head_dim: Per-head size (even).
        max_seq_len: Number of positions.
        theta: Base frequency.
        scaling: Llama 3.1-style frequency scaling or YaRN (None: none).

    Returns:
        ``table[..., 0]`` is cos, ``table[..., 1]`` is sin (float32).

    See Also:
        :titan:`torchtitan.models.common.rope.precompute_freqs_cis`: TorchTitan's complex table.
    """
    if isinstance(scaling, YarnRopeScaling):
        freqs = scaling.frequencies(head_dim, theta)
    else:
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            freqs = scaling.scale(freqs)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    if isinstance(scaling, YarnRopeScaling) and scaling.cos_sin_scale != 1.0:
        table = table * scaling.cos_sin_scale
    return table


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (B, S, H, D); rope: (S, D/2, 2)
    B, S, H, D = x.shape
    pairs = x.float().reshape(B, S, H, D // 2, 2)
    cos = rope[:S, :, 0].view(1, S, 1, D // 2)
    sin = rope[:S, :, 1].view(1, S, 1, D // 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.reshape(B, S, H, D).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnable scale.

    Args:
        dim: Normalized (last) dimension.
        eps: Added to the mean square.

    See Also:
        :pt:`torch.nn.RMSNorm`: PyTorch's RMSNorm (this one computes in float32).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` over its last dimension and scale it.

        Args:
            x: Input tensor.

        Returns:
            The normalized tensor, in ``x``'s dtype.

        See Also:
            :pt:`torch.nn.RMSNorm.forward`.
        """
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the scale to ones.

        See Also:
            :pt:`torch.nn.RMSNorm.reset_parameters`.
        """
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional per-head QK-norm.

    Args:
        args: Model arguments.

    See Also:
        :titan:`torchtitan.models.llama3.model.model.Attention`: TorchTitan's attention.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        assert args.head_dim is not None
        assert args.n_kv_heads is not None
        self.head_dim = args.head_dim
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        #: which keys a query sees, as the architecture defines it (documents come per batch)
        self.mask_spec = MaskSpec()
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table from :func:`precompute_rope`.
            masks: The batch's masks and backend
                (:class:`~hp_trainer.models.common.attention.AttentionMasks`: documents of
                packed samples, ``flex`` / ``varlen``); None: SDPA's causal path.

        Returns:
            ``(batch, seq, dim)`` output.

        See Also:
            :pt:`torch.nn.functional.scaled_dot_product_attention`: the attention kernel used.
        """
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
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
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        return result

    def init_weights(self, init_std: float) -> None:
        """Initialize the projections (truncated normal) and the QK norms.

        Args:
            init_std: Standard deviation of ``wo``; the input projections use 0.02.

        See Also:
            :titan:`torchtitan.models.llama3.model.model.Attention.init_weights`.
        """
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``.

    Args:
        dim: Model hidden size.
        hidden_dim: Inner size.

    See Also:
        :titan:`torchtitan.models.llama3.model.model.FeedForward`: TorchTitan's SwiGLU.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the SwiGLU MLP.

        Args:
            x: ``(..., dim)`` input.

        Returns:
            ``(..., dim)`` output.

        See Also:
            :pt:`torch.nn.functional.silu`.
        """
        result: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return result

    def init_weights(self, init_std: float) -> None:
        """Initialize ``w1`` with std 0.02 and ``w2``/``w3`` with ``init_std``.

        Args:
            init_std: Standard deviation of the output-side projections.

        See Also:
            :titan:`torchtitan.models.llama3.model.model.FeedForward.init_weights`.
        """
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``.

    Args:
        layer_id: Index of the block (for depth-scaled init).
        args: Model arguments.

    See Also:
        :titan:`torchtitan.models.llama3.model.model.TransformerBlock`: TorchTitan's block.
    """

    moe_enabled = False

    def __init__(self, layer_id: int, args: DecoderArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim or compute_ffn_hidden_dim(
            args.dim, args.multiple_of, args.ffn_dim_multiplier
        )
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, hidden)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """Run attention and the MLP with residual connections.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table.
            masks: The batch's attention masks, or None (see :meth:`Attention.forward`).

        Returns:
            ``(batch, seq, dim)`` output.

        See Also:
            :titan:`torchtitan.models.llama3.model.model.TransformerBlock.forward`.
        """
        h: torch.Tensor = x + self.attention(self.attention_norm(x), rope, masks=masks)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

    def init_weights(self) -> None:
        """Initialize norms and projections.

        See Also:
            :titan:`torchtitan.models.llama3.model.model.TransformerBlock.init_weights`.
        """
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Decoder(nn.Module):
    """Token embedding, a ``ModuleDict`` of blocks, final norm and LM head.

    Blocks live in a ``ModuleDict`` keyed ``"0"``, ``"1"``, ... so fully-qualified names stay
    stable when pipeline stages drop some of them.

    Args:
        args: Model arguments.

    See Also:
        :titan:`torchtitan.models.common.decoder.Decoder`: TorchTitan's decoder.
    """

    rope_cache: torch.Tensor

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        assert args.head_dim is not None
        self.args = args
        self.enable_weight_tying = args.enable_weight_tying
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope_cache",
            precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling),
            persistent=False,
        )

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: ``(batch, seq)`` token ids.
            document_ids: Keyword-only extension: ``(batch, seq)`` document index of every
                position of packed sequences (from
                :class:`~hp_trainer.models.common.document_mask.DocumentBoundaries`); attention then
                stays inside each document (block-causal). RoPE positions do not restart per
                document. None: causal.

        Returns:
            ``(batch, seq, vocab)`` logits (a DTensor sharded on the vocabulary under loss
            parallel).

        See Also:
            :titan:`torchtitan.models.common.decoder.Decoder.forward`.
        """
        # a pipeline stage holds some of the parts: the others are None (hp-pp's splitter)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache
        masks = None  # SDPA's causal path (what context parallelism redirects)
        if document_ids is not None or self.args.attn_backend != "sdpa":
            # one set of masks for the batch, lowered once per spec, shared by every layer
            masks = AttentionMasks(
                self.args.attn_backend,
                h.shape[1],
                batch_size=h.shape[0],
                document_ids=document_ids,
                device=h.device,
            )
        for layer in self.layers.values():
            h = layer(h, rope, masks=masks)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h  # type: ignore[no-any-return]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and recompute the RoPE table.

        Works on plain tensors and on DTensors (after sharding on the meta device and
        ``to_empty``).

        Args:
            buffer_device: Device for the RoPE table (default: where it is now, or CPU for meta).

        See Also:
            :titan:`torchtitan.protocols.model.BaseModel.init_weights`: TorchTitan's init protocol.
        """
        device = buffer_device or self.rope_cache.device
        if device.type == "meta":
            device = torch.device("cpu")
        assert self.args.head_dim is not None
        self.rope_cache = precompute_rope(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.args.rope_scaling
        ).to(device)
        std_emb = 0.02 if self.enable_weight_tying else 1.0
        if self.tok_embeddings is not None:  # None in later pipeline stages
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std_emb)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.enable_weight_tying and self.lm_head is not None:
            cutoff = 3.0
            std_out = self.args.dim**-0.5
            nn.init.trunc_normal_(
                self.lm_head.weight, std=std_out, a=-cutoff * std_out, b=cutoff * std_out
            )

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * non-embedding params + 12 * layers * dim * seq``.

        Args:
            seq_len: Training sequence length.

        Returns:
            FLOPs per token (forward + backward).

        See Also:
            :titan:`torchtitan.models.utils.get_dense_model_nparams_and_flops`: TorchTitan's
            formula.
        """
        nparams = sum(p.numel() for p in self.parameters())
        nparams_embedding = self.tok_embeddings.weight.numel()
        if self.enable_weight_tying:
            nparams_embedding = 0  # the matrix is used as the LM head: its matmul counts
        assert self.args.head_dim is not None
        attn = 12 * self.args.n_layers * self.args.n_heads * self.args.head_dim * seq_len
        return 6 * (nparams - nparams_embedding) + attn
