"""DeepSeek-V3: multi-head latent attention, dense first blocks, shared + routed experts.

The router scores experts with a sigmoid, limits each token to its best expert groups, picks the
top k by ``score + expert_bias`` (the auxiliary-loss-free balancing bias, updated after every
optimizer step from the step's global expert load) and weights the experts' outputs by the
unbiased scores, renormalized and scaled. Queries and keys keep their rotary part interleaved
(HF's ``rope_interleave``), so an export needs no permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hp_cp_ep import MoEArgs
from hp_trainer.models.common.attention import AttentionMasks, MaskSpec, attention
from hp_trainer.models.common.decoder import RMSNorm, YarnRopeScaling, apply_rope
from hp_trainer.models.common.moe_decoder import MoEDecoder, MoEDecoderArgs

__all__ = ["DeepSeekV3", "DeepSeekV3Args", "MLAttention", "deepseek_v3_routing"]


@dataclass(kw_only=True)
class DeepSeekV3Args(MoEDecoderArgs):
    """:class:`~hp_trainer.models.common.moe_decoder.MoEDecoderArgs` plus latent-attention sizes.

    ``head_dim`` is set to ``qk_nope_head_dim + qk_rope_head_dim`` (the query/key size).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.args.DeepSeekV3ModelArgs`.
    """

    hf_model_type: ClassVar[str] = "deepseek_v3"

    q_lora_rank: int = 0
    """Rank of the low-rank query projection; 0 keeps a full ``wq``."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """Per-head query/key size without rotary embedding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key size with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value size."""

    def __post_init__(self) -> None:
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        super().__post_init__()
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), causal, with a shared rotary key.

    Queries: ``wq`` (or ``wq_b(q_norm(wq_a x))`` with a query LoRA rank); keys and values from
    one latent ``wkv_a x = [c, k_rope]``: ``wkv_b(kv_norm(c))`` gives every head's ``k_nope``
    and ``v``, and ``k_rope`` is rotated once and shared by all heads.

    Args:
        args: Model arguments.

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.model.Attention`;
        ``transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention``.
    """

    def __init__(self, args: MoEDecoderArgs) -> None:
        super().__init__()
        if not isinstance(args, DeepSeekV3Args):
            raise TypeError(f"MLAttention needs DeepSeekV3Args, got {type(args).__name__}")
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        #: which keys a query sees, as the architecture defines it (documents come per batch)
        self.mask_spec = MaskSpec()
        #: the softmax scale, SDPA's default (None), times YaRN's ``mscale_all_dim`` correction
        self.softmax_scale: float | None = None
        if isinstance(args.rope_scaling, YarnRopeScaling):
            factor = args.rope_scaling.softmax_scale_factor
            if factor != 1.0:
                head = self.qk_nope_head_dim + self.qk_rope_head_dim
                self.softmax_scale = head**-0.5 * factor

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table of ``qk_rope_head_dim``.
            masks: The batch's attention masks
                (:class:`~hp_trainer.models.common.attention.AttentionMasks`), or None for
                SDPA's causal path.

        Returns:
            ``(batch, seq, dim)`` output.

        See Also:
            :pt:`torch.nn.functional.scaled_dot_product_attention` (scale
            ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's
            ``softmax_scale_factor`` with ``mscale_all_dim``).
        """
        B, S, _ = x.shape
        q, k, v, _ = self.project(x, rope)
        pad = q.shape[-1] - self.v_head_dim
        if pad > 0:
            # fused kernels (the CPU flash kernel context parallelism runs on, flash on GPUs)
            # need one head size: zero value columns add exact zeros, sliced off again
            v = F.pad(v, (0, pad))
        out = attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            spec=self.mask_spec,
            masks=masks,
            scale=self.softmax_scale,
        )
        out = out[..., : self.v_head_dim]
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        return result

    def project(
        self, x: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries, keys and values of every (local) head, rotary parts rotated.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table of ``qk_rope_head_dim``.

        Returns:
            ``(q, k, v, q_latent)``: ``q`` and ``k`` ``(batch, seq, heads, qk_nope_head_dim +
            qk_rope_head_dim)``, ``v`` ``(batch, seq, heads, v_head_dim)``, and the normalized
            query latent ``q_norm(wq_a x)`` (None without a query LoRA rank), which
            DeepSeek-V3.2's indexer reads.
        """
        B, S, _ = x.shape
        q_latent: torch.Tensor | None = None
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None
            assert self.q_norm is not None
            assert self.wq_b is not None
            q_latent = self.q_norm(self.wq_a(x))
            q = self.wq_b(q_latent)
        q = q.view(B, S, -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(
            B, S, -1, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return q, k, v, q_latent

    def init_weights(self, init_std: float) -> None:
        """Truncated-normal projections (``wo`` with ``init_std``, the others 0.02); norms 1.

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.model.Attention.init_weights`.
        """
        for lin in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if lin is not None:
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()


def deepseek_v3_routing(
    num_experts: int, top_k: int, shared: int, groups: int | None, limited: int | None, scale: float
) -> MoEArgs:
    """DeepSeek-V3's router: sigmoid scores, group-limited top k, the balancing bias.

    Args:
        num_experts: Routed experts.
        top_k: Experts per token.
        shared: Shared experts.
        groups: Expert groups (None: no group limit).
        limited: Groups a token may reach.
        scale: Routed scaling factor.

    Returns:
        The routing arguments.
    """
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=shared,
        score_func="sigmoid",
        route_norm=True,
        route_scale=scale,
        score_before_experts=False,
        num_expert_groups=groups,
        num_limited_groups=limited,
        top_k=top_k,
        load_balance_coeff=1e-3,
    )


class DeepSeekV3(MoEDecoder):
    """The DeepSeek-V3 decoder: latent attention, dense first blocks, then MoE blocks.

    Args:
        args: Model arguments (an entry of ``deepseek_v3_flavors`` in
            ``hp_trainer.models.deepseek_v3.flavors``).

    See Also:
        :titan:`torchtitan.models.deepseek_v3.model.model.DeepSeekV3Model`;
        ``transformers.DeepseekV3ForCausalLM``.
    """

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args, MLAttention, rope_dim=args.qk_rope_head_dim)
