"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA).

Every latent-attention layer gets a *lightning indexer*: a few small heads of its own (queries
from the query latent ``q_norm(wq_a x)``, one key head from ``x`` through ``wk`` and a
LayerNorm, the first ``qk_rope_head_dim`` dimensions of both rotated in halves as HF does) that
score every earlier token as ``sum_h w_h relu(q_h . k / sqrt(index_head_dim))``, with per-query
head weights ``w = weights_proj(x) / sqrt(index_n_heads)``. Each query then attends to its
``index_topk`` best-scoring visible tokens only. The scoring, the top-k and the sparse attention
are hp-cp-ep's (``hp_cp_ep.dsa.indexer_topk``, ``hp_cp_ep.dsa.sparse_attention``).

The indexer is trained by its own loss (the report's two stages, see
:class:`~hp_trainer.models.deepseek_v32.model.DSAttention`):
a KL divergence between the main attention's distribution (summed over heads, normalized) and
the softmax of the indexer's scores, dense during the warm-up (main model frozen, attention
dense) and over the selected tokens in the sparse stage; its inputs are detached, so the
language-modelling loss never reaches the indexer and the indexer loss never reaches the
main model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_cp_ep.dsa import (
    indexer_scores,
    indexer_topk,
    sparse_indexer_loss,
    sparse_latent_attention,
)
from hp_trainer.models.common.attention import AttentionMasks, attention
from hp_trainer.models.common.decoder import apply_rope
from hp_trainer.models.common.moe_decoder import MoEDecoder, MoEDecoderArgs
from hp_trainer.models.deepseek_v3.model import DeepSeekV3Args, MLAttention

__all__ = [
    "INDEXER_STAGES",
    "DSAttention",
    "DeepSeekV32",
    "DeepSeekV32Args",
    "LightningIndexer",
    "indexer_kl_divergence",
]

IndexerStage = Literal["dense_warmup", "sparse"]
INDEXER_STAGES: tuple[str, ...] = ("dense_warmup", "sparse")
"""The indexer's training stages (``[dsa] indexer_stage``)."""


@dataclass(kw_only=True)
class DeepSeekV32Args(DeepSeekV3Args):
    """:class:`~hp_trainer.models.deepseek_v3.model.DeepSeekV3Args` plus the indexer's sizes.

    DeepSeek-V3.2 always has a query latent (``q_lora_rank > 0``): the indexer's queries are
    projected from it.

    Raises:
        ValueError: ``q_lora_rank`` 0, an indexer head count or ``index_topk`` below 1, or an
            ``index_head_dim`` smaller than ``qk_rope_head_dim`` (the rotated part of the
            indexer's heads), naming the values.

    See Also:
        ``transformers.DeepseekV32Config`` (``index_n_heads``, ``index_head_dim``,
        ``index_topk``).
    """

    hf_model_type: ClassVar[str] = "deepseek_v32"

    q_lora_rank: int = 1536
    """Rank of the query latent; DeepSeek-V3.2 needs one, the indexer reads it."""
    index_n_heads: int = 64
    """Heads of the lightning indexer."""
    index_head_dim: int = 128
    """Per-head size of the indexer's queries and its one key head (the first
    ``qk_rope_head_dim`` dimensions rotated)."""
    index_topk: int = 2048
    """Tokens each query attends to (all visible ones when fewer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.q_lora_rank < 1:
            raise ValueError(
                f"q_lora_rank = {self.q_lora_rank}: DeepSeek-V3.2's indexer projects its "
                "queries from the query latent, expected q_lora_rank >= 1"
            )
        for name in ("index_n_heads", "index_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim = {self.index_head_dim} is smaller than qk_rope_head_dim = "
                f"{self.qk_rope_head_dim}: the indexer rotates the first qk_rope_head_dim "
                "dimensions of its heads, expected index_head_dim >= qk_rope_head_dim"
            )


def _rope_halves(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (B, S, H, R) rotated as two halves (HF's rotate_half), rope: (S, R/2, 2)
    S, half = x.shape[1], x.shape[-1] // 2
    cos = rope[:S, :, 0].view(1, S, 1, half).to(x.dtype)
    sin = rope[:S, :, 1].view(1, S, 1, half).to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: its own heads, one shared key, per-query head weights.

    Args:
        args: Model arguments.

    See Also:
        ``transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Indexer``.
    """

    def __init__(self, args: DeepSeekV32Args) -> None:
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        #: the scale of the query/key dot products
        self.softmax_scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's queries, keys and head weights.

        Args:
            x: ``(batch, seq, dim)`` the attention's input.
            q_latent: ``(batch, seq, q_lora_rank)`` the normalized query latent.
            rope: RoPE table of ``qk_rope_head_dim``.

        Returns:
            ``(q, k, weights)``: ``(batch, seq, index_n_heads, index_head_dim)``,
            ``(batch, seq, index_head_dim)`` and ``(batch, seq, index_n_heads)`` (already
            scaled by ``index_n_heads ** -0.5``), as ``hp_cp_ep.dsa.indexer_topk`` takes
            them.
        """
        B, S, _ = x.shape
        q = self.wq_b(q_latent).view(B, S, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        r = self.rope_dim
        q = torch.cat([_rope_halves(q[..., :r], rope), q[..., r:]], dim=-1)
        k = torch.cat([_rope_halves(k[..., :r], rope), k[..., r:]], dim=-1).squeeze(2)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, k, weights

    def init_weights(self, init_std: float = 0.02) -> None:
        """Truncated-normal projections (std ``init_std``); the key norm to (1, 0)."""
        for lin in (self.wq_b, self.wk, self.weights_proj):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)
        self.k_norm.reset_parameters()


def indexer_kl_divergence(
    target: torch.Tensor, index_scores: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """``KL(target || softmax(index_scores))`` of every query over its visible keys.

    Args:
        target: ``(..., N)`` probabilities (each row sums to 1 over ``visible``, 0 elsewhere):
            the main attention's distribution summed over heads and normalized.
        index_scores: ``(..., N)`` the indexer's scores of the same keys.
        visible: ``(..., N)`` bool, the keys each query sees (at least one per row).

    Returns:
        ``(...)`` float32 KL divergence per query (0 when the indexer's softmax reproduces the
        target); differentiable in ``index_scores``.

    See Also:
        :pt:`torch.nn.functional.kl_div`: the same divergence (``reduction="none"``, summed
        over the last dimension) on log-probabilities.
    """
    logits = index_scores.float().masked_fill(~visible, float("-inf"))
    log_q = torch.log_softmax(logits, dim=-1).masked_fill(~visible, 0.0)
    target = target.float()
    return (torch.xlogy(target, target) - target * log_q).sum(dim=-1)


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``out``; the backward also gives ``loss`` the gradient 1.

    The indexer's loss thus trains the indexer without the training loop adding it to its loss
    (as hp-cp-ep's MoE does with its auxiliary loss).
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


class DSAttention(MLAttention):
    """Latent attention over the tokens a lightning indexer selects (DeepSeek Sparse Attention).

    Queries, keys and values are :class:`~hp_trainer.models.deepseek_v3.model.MLAttention`'s;
    the indexer (:class:`LightningIndexer`, reading the detached input and query latent) picks
    each query's ``index_topk`` visible keys (causal, and within its document when the batch
    has document ids) and the attention runs on those only.

    The indexer's training (set by the trainer from ``[dsa]``, or by hand):

    - ``indexer_stage = "sparse"`` (default): sparse attention; when ``indexer_loss_coeff > 0``
      in training, the indexer's loss is the KL divergence, over each query's selected keys,
      from the main attention's probabilities summed over heads (normalized) to the softmax
      of the indexer's scores;
    - ``indexer_stage = "dense_warmup"``: dense attention (the indexer selects nothing), and
      the same KL over every visible key; the trainer freezes the rest of the model.

    The loss is averaged over the queries (or divided by ``indexer_loss_tokens`` when set:
    the trainer sets the step's global query count so that every rank's and micro-batch's
    share adds up to one mean), multiplied by ``indexer_loss_coeff`` and added to the
    gradient of the indexer alone. The last value is kept in ``indexer_loss`` (detached).

    Args:
        args: Model arguments (:class:`~hp_trainer.DeepSeekV32Args`).

    Raises:
        TypeError: If ``args`` is not a :class:`~hp_trainer.DeepSeekV32Args`.

    See Also:
        ``transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention``;
        ``hp_cp_ep.dsa.sparse_attention``.
    """

    def __init__(self, args: MoEDecoderArgs) -> None:
        if not isinstance(args, DeepSeekV32Args):
            raise TypeError(f"DSAttention needs DeepSeekV32Args, got {type(args).__name__}")
        super().__init__(args)
        self.indexer = LightningIndexer(args)
        self.index_topk = args.index_topk
        #: the indexer's training stage, ``"sparse"`` or ``"dense_warmup"``
        self.indexer_stage: IndexerStage = "sparse"
        #: weight of the indexer's KL loss; 0 means no loss, the indexer is not trained
        self.indexer_loss_coeff = 0.0
        #: the loss's divisor; None divides by the number of queries of the forward
        self.indexer_loss_tokens: int | None = None
        #: the last forward's indexer loss (detached), None before or without one
        self.indexer_loss: torch.Tensor | None = None
        #: under tensor parallel, the group whose ranks hold the other heads (their
        #: probabilities are summed into the indexer's target)
        self.head_group: dist.ProcessGroup | None = None

    def latent_rows(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """One compressed key/value row per position: ``[kv_norm(latent), rotated k_rope]``.

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table of ``qk_rope_head_dim``.

        Returns:
            ``(batch, seq, kv_lora_rank + qk_rope_head_dim)``; :meth:`expand` gives every
            head's key and value. Under context parallelism only the selected rows travel.
        """
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope).squeeze(2)
        return torch.cat([self.kv_norm(latent), k_rope], dim=-1)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every (local) head from compressed rows.

        Args:
            rows: ``(n, kv_lora_rank + qk_rope_head_dim)`` rows of :meth:`latent_rows`.

        Returns:
            ``(k, v)``: ``(n, heads, qk_nope_head_dim + qk_rope_head_dim)`` and
            ``(n, heads, v_head_dim)``.
        """
        latent, k_rope = torch.split(rows, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(latent).view(rows.shape[0], -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)
        return k, v

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """Attend over the indexer's selection (dense in the warm-up stage).

        Args:
            x: ``(batch, seq, dim)`` input.
            rope: RoPE table of ``qk_rope_head_dim``.
            masks: The batch's attention masks (their document ids restrict the selection),
                or None.

        Returns:
            ``(batch, seq, dim)`` output.

        See Also:
            ``hp_cp_ep.dsa.indexer_topk``, ``hp_cp_ep.dsa.sparse_latent_attention`` and
            ``hp_cp_ep.dsa.sparse_indexer_loss`` (context-parallel inside this module when
            hp-cp-ep's DSA styles are applied to it).
        """
        B, S, _ = x.shape
        assert self.wq_a is not None
        assert self.q_norm is not None
        assert self.wq_b is not None
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(B, S, -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1).transpose(1, 2)
        rows = self.latent_rows(x, rope)
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        documents = masks.document_ids if masks is not None else None
        dense = self.indexer_stage == "dense_warmup"
        with_loss = self.training and self.indexer_loss_coeff > 0 and torch.is_grad_enabled()
        selected: torch.Tensor | None = None
        iq = ik = weights = None
        if not dense or with_loss:
            # detached: the indexer is trained by its own loss only
            iq, ik, weights = self.indexer(x.detach(), q_latent.detach(), rope)
        if dense:
            k, v = (
                t.view(B, S, *t.shape[1:]).transpose(1, 2) for t in self.expand(rows.flatten(0, 1))
            )
            pad = q.shape[-1] - self.v_head_dim
            padded = F.pad(v, (0, pad)) if pad > 0 else v
            out = attention(
                q, k, padded, spec=self.mask_spec, masks=masks, scale=self.softmax_scale
            )[..., : self.v_head_dim]
        else:
            assert iq is not None
            assert ik is not None
            assert weights is not None
            selected = indexer_topk(
                iq,
                ik,
                weights,
                self.index_topk,
                softmax_scale=self.indexer.softmax_scale,
                document_ids=documents,
            )
            out = sparse_latent_attention(q, rows, selected, scale=scale, expand=self.expand)
        if with_loss:
            assert iq is not None
            assert ik is not None
            assert weights is not None
            loss = self._indexer_loss(q, rows, scale, iq, ik, weights, documents, selected)
            self.indexer_loss = loss.detach()
            out = _AddLossGradient.apply(out, loss * self.indexer_loss_coeff)  # type: ignore[no-untyped-call]
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        return result

    def _indexer_loss(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        scale: float,
        iq: torch.Tensor,
        ik: torch.Tensor,
        weights: torch.Tensor,
        documents: torch.Tensor | None,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """The indexer's KL loss of this forward (summed over queries, then divided).

        The sparse stage without tensor parallelism is hp-cp-ep's ``sparse_indexer_loss``
        (context-parallel under its style); the dense warm-up, and the sparse stage whose heads
        are split over TP ranks (the target sums every rank's heads), compute the target here.
        """
        B, _, S, _ = q.shape
        tokens = self.indexer_loss_tokens if self.indexer_loss_tokens is not None else B * S
        if selected is not None and self.head_group is None:
            kl = sparse_indexer_loss(
                iq,
                ik,
                weights,
                q,
                rows,
                selected,
                softmax_scale=self.indexer.softmax_scale,
                scale=scale,
                expand=self.expand,
            )
            return kl.sum() / tokens
        scores = indexer_scores(iq, ik, weights, softmax_scale=self.indexer.softmax_scale)
        with torch.no_grad():
            k, _ = self.expand(rows.flatten(0, 1))
            k = k.view(B, S, *k.shape[1:]).transpose(1, 2)
            logits = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, S, T)
            if selected is None:  # the dense warm-up: every visible key
                pos = torch.arange(S, device=q.device)
                visible = (pos.view(1, S, 1) >= pos.view(1, 1, S)).expand(B, S, S)
                if documents is not None:
                    visible = visible & (documents.unsqueeze(-1) == documents.unsqueeze(-2))
            else:  # the sparse stage: the selected keys only
                visible = selected >= 0
                safe = selected.clamp(min=0)
                logits = logits.gather(-1, safe.unsqueeze(1).expand(-1, logits.shape[1], -1, -1))
            probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(1), float("-inf")), -1)
            target = probs.sum(dim=1)
            if self.head_group is not None:  # tensor parallel: the other ranks' heads
                dist.all_reduce(target, group=self.head_group)
            target = target / self.n_heads
        if selected is not None:
            scores = scores.gather(-1, selected.clamp(min=0))
        kl = indexer_kl_divergence(target, scores, visible)
        return kl.sum() / tokens

    def init_weights(self, init_std: float) -> None:
        """Latent attention's init, then the indexer's (std 0.02)."""
        super().init_weights(init_std)
        self.indexer.init_weights()


class DeepSeekV32(MoEDecoder):
    """The DeepSeek-V3.2 decoder: DeepSeek-V3 with
    :class:`~hp_trainer.models.deepseek_v32.model.DSAttention` in every block.

    Args:
        args: Model arguments (a
            ``deepseek_v32_flavors`` entry).

    See Also:
        ``transformers.DeepseekV32ForCausalLM``;
        :titan:`torchtitan.models.deepseek_v3.model.model.DeepSeekV3Model` (the V3 trunk).
    """

    def __init__(self, args: DeepSeekV32Args) -> None:
        super().__init__(args, DSAttention, rope_dim=args.qk_rope_head_dim)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token with attention over the selected tokens only.

        The dense attention term of ``MoEDecoder.num_flops_per_token`` is replaced by the
        same term over ``min(index_topk, seq_len)`` keys, plus the indexer scoring every key
        (``2 * index_n_heads * index_head_dim`` per key forward, twice that for the KL
        loss's backward).

        Args:
            seq_len: Training sequence length.

        Returns:
            FLOPs per token (forward + backward).
        """
        args = self.args
        assert isinstance(args, DeepSeekV32Args)
        per_key = 12 * args.n_layers * args.n_heads * self.attention_head_dim()
        keys = min(args.index_topk, seq_len)
        indexer = 6 * args.n_layers * args.index_n_heads * args.index_head_dim * seq_len
        return super().num_flops_per_token(seq_len) - per_key * (seq_len - keys) + indexer

    def dsa_attentions(self) -> list[DSAttention]:
        """The sparse-attention module of every block this model (or pipeline stage) holds."""
        return [m for m in self.modules() if isinstance(m, DSAttention)]
