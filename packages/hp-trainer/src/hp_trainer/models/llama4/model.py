"""Llama 4 (``Llama4ForCausalLM``, the text model): iRoPE, chunked attention, interleaved MoE.

Every block is pre-norm attention then a feed-forward, as the other decoders; what Llama 4 adds
is decided per block index ``i``:

- **iRoPE**: a block uses RoPE unless ``(i + 1) % no_rope_layer_interval == 0`` (HF's
  ``no_rope_layers`` flags, when given, decide instead). RoPE blocks attend inside chunks of
  ``attention_chunk_size`` positions (chunked attention) and, with ``qk_norm``, L2-normalize
  queries and keys per head after the rotation (a weightless RMS norm). NoPE blocks attend over
  the whole causal context, without rotation or QK-norm, and (``attn_temperature_tuning``)
  multiply the query at position ``p`` by ``1 + attn_scale * log(1 + floor((p + 1) /
  floor_scale))``.
- **Interleaved MoE**: blocks ``step - 1, 2 * step - 1, ...`` (``interleave_moe_layer_step``,
  or the explicit ``moe_layers``) hold a mixture of experts, the others a dense SwiGLU of
  ``ffn_hidden_dim`` (HF's ``intermediate_size_mlp``).
- **The router** takes the top ``k`` logits (k = 1 in the published models), scores each chosen
  expert with ``sigmoid(logit)`` (no renormalization) and multiplies the expert's *input* by
  the score (HF: ``routed_in = hidden * score``; the expert is nonlinear, so this is not the
  same as weighting its output). One shared expert of the routed experts' size sees every
  token, unscaled.

Queries and keys rotate interleaved pairs (elements ``2i``, ``2i + 1``) as in HF's Llama 4, so
an export needs no permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hp_cp_ep import MoE, MoEArgs
from hp_trainer.models.common.attention import AttentionMasks, MaskSpec, attention
from hp_trainer.models.common.decoder import FeedForward, RMSNorm, apply_rope, precompute_rope
from hp_trainer.models.common.moe_decoder import MoEBlock, MoEDecoder, MoEDecoderArgs

__all__ = ["Llama4", "Llama4Args", "Llama4Attention", "Llama4Block", "llama4_routing"]


def llama4_routing(num_experts: int, top_k: int = 1) -> MoEArgs:
    """Llama 4's router: top-k logits, sigmoid scores applied to the experts' input, 1 shared.

    Args:
        num_experts: Routed experts.
        top_k: Experts per token (1 in Scout and Maverick).

    Returns:
        The routing arguments (no renormalization, no balancing bias).
    """
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=False,
        score_before_experts=True,
        top_k=top_k,
        load_balance_coeff=None,
    )


@dataclass(kw_only=True)
class Llama4Args(MoEDecoderArgs):
    """:class:`~hp_trainer.models.common.moe_decoder.MoEDecoderArgs` plus Llama 4's layout.

    ``ffn_hidden_dim`` is the dense blocks' SwiGLU size (HF ``intermediate_size_mlp``),
    ``moe_hidden_dim`` each routed expert's and the shared expert's (HF
    ``intermediate_size``), ``qk_norm`` HF's ``use_qk_norm`` (weightless, RoPE blocks only).
    ``n_dense_layers`` is unused (the MoE blocks are interleaved).

    See Also:
        the families of :titan:`torchtitan.models` (Llama 4 among them);
        ``transformers.Llama4TextConfig``.
    """

    hf_model_type: ClassVar[str] = "llama4_text"

    interleave_moe_layer_step: int = 1
    """Every ``step``-th block (the last of each group of ``step``) is an MoE block."""
    moe_layers: tuple[int, ...] | None = None
    """Explicit MoE block indices (HF ``moe_layers``), or None to follow the interleave step."""
    no_rope_layer_interval: int = 4
    """Every ``interval``-th block (the last of each group) is a NoPE block."""
    no_rope_layers: tuple[int, ...] | None = None
    """HF's per-block flags, 1 for a RoPE block and 0 for a NoPE block, or None to follow the
    interval."""
    attention_chunk_size: int | None = 8192
    """RoPE blocks attend inside chunks of this many positions (None for full causal)."""
    attn_temperature_tuning: bool = True
    """Scale NoPE blocks' queries up with the position (see the module docstring)."""
    floor_scale: float = 8192.0
    """Positions per step of the temperature tuning."""
    attn_scale: float = 0.1
    """Strength of the temperature tuning."""
    rope_table_len: int = 131072
    """Most positions the RoPE table covers, which is ``min(max_seq_len, rope_table_len)``
    long (Scout's ``max_position_embeddings`` of 10M would take 5 GB of table); longer
    sequences are refused with a message naming this field."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("interleave_moe_layer_step", "no_rope_layer_interval", "rope_table_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Llama4Args.{name} must be a positive int, got {value!r}")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(
                f"Llama4Args.attention_chunk_size must be positive or None, got "
                f"{self.attention_chunk_size!r}"
            )
        if self.moe_layers is not None:
            self.moe_layers = tuple(int(i) for i in self.moe_layers)
            bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(
                    f"Llama4Args.moe_layers {list(self.moe_layers)} has indices {bad} outside "
                    f"the {self.n_layers} blocks"
                )
        if self.no_rope_layers is not None:
            self.no_rope_layers = tuple(int(f) for f in self.no_rope_layers)
            if len(self.no_rope_layers) < self.n_layers or set(self.no_rope_layers) - {0, 1}:
                raise ValueError(
                    f"Llama4Args.no_rope_layers must hold a 0/1 flag for each of the "
                    f"{self.n_layers} blocks, got {list(self.no_rope_layers)}"
                )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` holds a mixture of experts."""
        if self.moe_layers is not None:
            return layer_id in self.moe_layers
        return (layer_id + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` rotates queries and keys (False: a NoPE block)."""
        if self.no_rope_layers is not None:
            return bool(self.no_rope_layers[layer_id])
        return (layer_id + 1) % self.no_rope_layer_interval != 0


class _BatchMasks:
    """The batch's masks, lowered for the sequence length the attention sees.

    Under sequence parallel the residual stream (what the decoder sees) holds a slice of the
    sequence and the attention the whole of it, so the masks are built at the attention's
    length, once per batch and length, and shared by every block.
    """

    def __init__(
        self, backend: str, batch_size: int, document_ids: torch.Tensor | None, device: Any
    ) -> None:
        self.backend = backend
        self.batch_size = batch_size
        self.document_ids = document_ids
        self.device = device
        self._by_len: dict[int, AttentionMasks] = {}

    def at(self, seq_len: int) -> AttentionMasks:
        """The :class:`~hp_trainer.models.common.attention.AttentionMasks` for ``seq_len``."""
        if seq_len not in self._by_len:
            self._by_len[seq_len] = AttentionMasks(
                self.backend,
                seq_len,
                batch_size=self.batch_size,
                document_ids=self.document_ids,
                device=self.device,
            )
        return self._by_len[seq_len]


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's weightless RMS norm over the head dimension, in float32
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    """Grouped-query attention of one Llama 4 block: chunked RoPE or full NoPE.

    Args:
        args: Model arguments.
        layer_id: Index of the block (decides RoPE/NoPE and the mask).

    See Also:
        ``transformers.models.llama4.modeling_llama4.Llama4TextAttention``;
        :titan:`torchtitan.models` (TorchTitan's families, Llama 4 among them).
    """

    def __init__(self, args: Llama4Args, layer_id: int) -> None:
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
        #: whether this block rotates (and chunks), else it is a NoPE block
        self.use_rope = args.uses_rope(layer_id)
        self.qk_norm_eps: float | None = args.norm_eps if args.qk_norm and self.use_rope else None
        chunk = args.attention_chunk_size if self.use_rope else None
        #: which keys a query sees, as the architecture defines it (documents come per batch)
        self.mask_spec = MaskSpec(chunk_size=chunk)
        self.temperature: tuple[float, float] | None = None
        if args.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(args.floor_scale), float(args.attn_scale))

    def spec_for(self, seq_len: int) -> MaskSpec:
        """The mask at this sequence length: plain causal when one chunk covers it."""
        chunk = self.mask_spec.chunk_size
        return MaskSpec() if chunk is None or chunk >= seq_len else self.mask_spec

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        masks: AttentionMasks | _BatchMasks | None = None,
    ) -> torch.Tensor:
        """Attend over the sequence (chunked with RoPE, or full without).

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table (unused by NoPE blocks).
            masks: The batch's masks and backend
                (:class:`~hp_trainer.models.common.attention.AttentionMasks`, or the
                decoder's per-batch set); None: SDPA.

        Returns:
            ``(batch, seq, dim)`` output.

        See Also:
            :pt:`torch.nn.functional.scaled_dot_product_attention`.
        """
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        if self.use_rope:
            q = apply_rope(q, rope)
            k = apply_rope(k, rope)
        if self.qk_norm_eps is not None:
            q = _l2_norm(q, self.qk_norm_eps)
            k = _l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = torch.arange(S, device=q.device, dtype=torch.float32)
            scales = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales.view(1, S, 1, 1)).to(q.dtype)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            spec=self.spec_for(S),
            masks=masks.at(S) if isinstance(masks, _BatchMasks) else masks,
        )
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        return result

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal projections: ``wo`` with ``init_std``, the others 0.02."""
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class Llama4Block(MoEBlock):
    """A Llama 4 block: its attention (RoPE or NoPE) and a dense or MoE feed-forward.

    The same attributes as :class:`~hp_trainer.models.common.moe_decoder.MoEBlock`
    (``attention``, ``moe`` or ``feed_forward``, ``moe_enabled``), so the shared TP, EP and
    FSDP plans apply unchanged; only which blocks are MoE differs (interleaved).

    Args:
        layer_id: Index of the block.
        args: Model arguments.

    See Also:
        ``transformers.models.llama4.modeling_llama4.Llama4TextDecoderLayer``.
    """

    def __init__(self, layer_id: int, args: Llama4Args) -> None:
        nn.Module.__init__(self)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Llama4Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_hidden_dim)
        else:
            assert args.ffn_hidden_dim is not None
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)


class Llama4(MoEDecoder):
    """The Llama 4 text decoder: iRoPE, chunked attention, interleaved MoE with a shared expert.

    Args:
        args: Model arguments (an entry of ``llama4_flavors`` in
            ``hp_trainer.models.llama4.flavors``).

    See Also:
        :titan:`torchtitan.models` (TorchTitan's Llama 4 among them);
        ``transformers.Llama4ForCausalLM``.
    """

    args: Llama4Args

    def __init__(self, args: Llama4Args) -> None:
        nn.Module.__init__(self)
        assert args.head_dim is not None
        self.args = args
        self.rope_dim = args.head_dim
        self.enable_weight_tying = args.enable_weight_tying
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Llama4Block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._rope_table(), persistent=False)

    def _rope_table(self) -> torch.Tensor:
        args = self.args
        positions = min(args.max_seq_len, args.rope_table_len)
        return precompute_rope(self.rope_dim, positions, args.rope_theta, args.rope_scaling)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter (as the other MoE decoders) and recompute the RoPE table.

        Args:
            buffer_device: Device of the buffers (default: where they are, CPU for meta).

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.model.DeepSeekV3Model.init_weights`.
        """
        device = buffer_device or self.rope_cache.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.rope_cache = self._rope_table().to(device)
        std_emb = 0.02 if self.enable_weight_tying else 1.0
        if self.tok_embeddings is not None:  # None in later pipeline stages
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std_emb)
        for layer in self.layers.values():
            layer.init_weights(device)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.enable_weight_tying and self.lm_head is not None:
            std_out = self.args.dim**-0.5
            nn.init.trunc_normal_(self.lm_head.weight, std=std_out, a=-3 * std_out, b=3 * std_out)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: the active parameters' and each block's attention.

        As :meth:`~hp_trainer.models.common.moe_decoder.MoEDecoder.num_flops_per_token`, with
        a chunked block's attention over ``min(seq_len, attention_chunk_size)`` keys.

        Args:
            seq_len: Training sequence length.

        Returns:
            FLOPs per token (forward + backward).

        See Also:
            :titan:`torchtitan.models.utils.get_moe_model_nparams_and_flops`.
        """
        args = self.args
        assert args.head_dim is not None
        per_key = 12 * args.n_heads * args.head_dim
        chunk = args.attention_chunk_size
        keys = sum(
            min(seq_len, chunk) if chunk is not None and args.uses_rope(i) else seq_len
            for i in range(args.n_layers)
        )
        full_attention = per_key * args.n_layers * seq_len
        return super().num_flops_per_token(seq_len) - full_attention + per_key * keys

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: ``(batch, seq)`` token ids (hidden states in later pipeline stages).
            document_ids: Keyword-only: ``(batch, seq)`` document ids of packed samples
                (attention stays inside each document too); None: none.

        Returns:
            ``(batch, seq, vocab)`` logits.

        Raises:
            ValueError: A sequence longer than the RoPE table.

        See Also:
            ``transformers.Llama4ForCausalLM.forward``.
        """
        if self.tok_embeddings is not None:  # the first stage: ids of the whole sequence
            if tokens.shape[1] > self.rope_cache.shape[0]:
                raise ValueError(
                    f"sequence of {tokens.shape[1]} positions is longer than the RoPE table's "
                    f"{self.rope_cache.shape[0]} (min of max_seq_len and rope_table_len)"
                )
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        masks = None  # SDPA's causal path everywhere
        if (
            document_ids is not None
            or self.args.attention_chunk_size is not None
            or self.args.attn_backend != "sdpa"
        ):
            masks = _BatchMasks(self.args.attn_backend, h.shape[0], document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, masks=masks)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h  # type: ignore[no-any-return]
