"""What the cost model needs to know about a model: parameters by kind, FLOPs, activation sizes.

Counted from the model itself, built on the meta device (no memory, a fraction of a second even
for a 671B model), so every registered family is covered the same way the trainer builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

__all__ = ["ModelStats", "model_stats"]


@dataclass(frozen=True)
class ModelStats:
    """Sizes of one model, per layer where layers differ (dense and MoE blocks).

    Attributes:
        name: ``model/flavor``.
        n_layers: Transformer blocks.
        dim: Hidden size.
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        vocab_size: Vocabulary size.
        tied: Whether the embedding and the LM head share a matrix.
        embed_params: Parameters of the token embedding.
        head_params: Parameters of the final norm and the LM head (0 for the head when tied).
        layer_dense_params: Per block: parameters that every token uses (attention, dense FFN,
            router, shared experts, norms).
        layer_expert_params: Per block: parameters of the routed experts (all of them).
        num_experts: Routed experts of a MoE block (0: dense model).
        top_k: Experts per token.
        layer_act_elems: Per block: activation elements per token kept for the backward
            (inputs of the matmuls and of the nonlinearities), in the compute dtype, before any
            TP split.
        layer_act_fixed_bytes: Per block: activation bytes per token kept for the backward whose
            dtype does not follow the compute dtype (a MoE router's float32 scores, its int64
            expert indices and token permutation).
        layer_bwd_temp_elems: Per block: the largest set of input gradients its backward holds
            at once beside the saved tensors, in compute-dtype elements per token: the largest
            of a SwiGLU's (both factors' gradients, the product's saved copy freed by then), an
            attention's (q, k and v as its kernel sees them) and a MoE's (per routed copy: the
            combine's gradient row, its gather and its weighting, or the experts' row gradient
            and two factor gradients).
        flops_per_token: Training FLOPs per token at ``seq_len`` (the trainer's MFU formula:
            ``6 * active non-embedding params + 12 * layers * heads * head_dim * seq``).
        seq_len: The sequence length ``flops_per_token`` is for.
        kernels_per_layer: Operators one block's forward launches (the per-launch overhead).
    """

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    tied: bool
    embed_params: int
    head_params: int
    layer_dense_params: tuple[int, ...]
    layer_expert_params: tuple[int, ...]
    num_experts: int
    top_k: int
    layer_act_elems: tuple[float, ...]
    flops_per_token: float
    seq_len: int
    kernels_per_layer: int
    layer_act_fixed_bytes: tuple[float, ...] = ()
    layer_bwd_temp_elems: tuple[float, ...] = ()

    def layer_act_bytes(self, dtype_bytes: int) -> float:
        """The largest block's activation bytes per token for a compute dtype of
        ``dtype_bytes`` bytes (before any TP split)."""
        return _layer_act_bytes(self.layer_act_elems, self.layer_act_fixed_bytes, dtype_bytes)

    @property
    def total_params(self) -> int:
        """All parameters."""
        return (
            self.embed_params
            + self.head_params
            + sum(self.layer_dense_params)
            + sum(self.layer_expert_params)
        )

    @property
    def is_moe(self) -> bool:
        """Whether some block has routed experts."""
        return self.num_experts > 0

    def flops_per_token_at(self, seq_len: int) -> float:
        """``flops_per_token`` for another sequence length (the attention term scales)."""
        head_dim = self.dim // self.n_heads
        attn = 12 * self.n_layers * self.n_heads * head_dim
        return self.flops_per_token + attn * (seq_len - self.seq_len)


@lru_cache(maxsize=256)
def _layer_act_bytes(elems: tuple[float, ...], fixed: tuple[float, ...], dtype_bytes: int) -> float:
    fixed = fixed or (0.0,) * len(elems)
    return max(e * dtype_bytes + f for e, f in zip(elems, fixed, strict=True))


def _linear_out(module: nn.Module) -> int:
    """Output features of the linear layers under ``module`` (what each produces per token)."""
    return sum(int(m.weight.shape[0]) for m in module.modules() if isinstance(m, nn.Linear))


def _norm_act(norm: nn.Module | None, width: int, rows: int) -> float:
    """Elements per token an RMSNorm over ``rows`` vectors of ``width`` keeps: its input, the
    normalized input (the weight's gradient) and one statistic per vector."""
    if not isinstance(norm, nn.Module) or not any(True for _ in norm.parameters()):
        return 0.0
    return float(rows * (2 * width + 1))


def _mla_act(attn: nn.Module, dim: int) -> float:
    """Elements per token DeepSeek's multi-head latent attention keeps: its input (the
    projections' input), the query latent's RMSNorm and ``wq_b``'s input (with a query LoRA
    rank), the key/value latent's (``wkv_a``'s output, the normalized latent, ``wkv_b``'s
    input), q, k and v as the attention kernel keeps them (v padded to the query/key head size),
    its output at that size, and ``wo``'s input (the output sliced to the value head size)."""
    heads = int(getattr(attn, "n_heads"))  # noqa: B009
    qk = int(getattr(attn, "qk_nope_head_dim")) + int(getattr(attn, "qk_rope_head_dim"))  # noqa: B009
    vd = int(getattr(attn, "v_head_dim"))  # noqa: B009
    latent = int(getattr(attn, "kv_lora_rank"))  # noqa: B009
    q_rank = int(getattr(attn, "q_lora_rank", 0) or 0)
    act = float(dim)
    if q_rank:
        act += 3 * q_rank + 1
    act += latent + int(getattr(attn, "qk_rope_head_dim")) + 2 * latent + 1  # noqa: B009
    act += 4 * heads * max(qk, vd) + heads + heads * vd
    return act


def _block_stats(
    block: nn.Module, dim: int, top_k: int
) -> tuple[int, int, int, float, float, float, int]:
    """(dense params, expert params, experts, activation elements per token, activation bytes
    per token in fixed dtypes, backward temporaries per token, kernels)."""
    dense = expert = n_experts = 0
    act = 0.0
    fixed = 0.0
    temp = 0.0
    kernels = 0
    for name, child in block.named_children():
        params = sum(p.numel() for p in child.parameters())
        linears = sum(1 for m in child.modules() if isinstance(m, nn.Linear))
        if params == 0:
            continue
        if sum(p.numel() for p in child.parameters(recurse=False)) == params and params <= 4 * dim:
            # a norm: its input (and fp32 statistics) are kept
            dense += params
            act += 2 * dim
            kernels += 4
            continue
        experts = getattr(child, "experts", None)
        if isinstance(experts, nn.Module) and hasattr(child, "num_experts"):
            n_experts = int(getattr(child, "num_experts"))  # noqa: B009
            e_params = sum(p.numel() for p in experts.parameters())
            expert += e_params
            dense += params - e_params
            hidden = e_params // (3 * n_experts * dim)
            # per routed copy (one row per token and choice, permuted; under EP the rows this
            # rank received): the experts' input rows, w1's and w3's outputs, silu's output,
            # their product (w2's input), and the experts' output rows (kept by the combine to
            # weight them, or before the experts the scored input rows)
            act += top_k * (2 * dim + 4 * hidden)
            # backward: the combine's (per routed copy the gradient row, its gather and its
            # weighting) or the experts' (the row's gradient and two factor gradients)
            temp = max(temp, top_k * max(3.0 * dim, dim + 2.0 * hidden))
            shared = getattr(child, "shared_experts", None)
            if isinstance(shared, nn.Module):
                # a SwiGLU on every token (its input is the router's, counted below): w1's and
                # w3's outputs, silu's output and their product (its linears put out w1: h,
                # w3: h, w2: dim)
                act += 4 * ((_linear_out(shared) - dim) // 2)
            # the router: its input (the normalized tokens, the gate's input) and the combine
            # weights of the top-k choices in the compute dtype; in float32 its scores over
            # the experts (kept by the top-k gather), the top-k scores and their sum (route
            # normalization); in int64 the chosen experts and the token permutation
            act += dim + top_k
            fixed += 4 * n_experts + 4 * (top_k + 1) + 2 * 8 * top_k
            kernels += 30 + 3 * linears
            continue
        dense += params
        out = _linear_out(child)
        if "attention" in name or "attn" in name:
            heads, head_dim = getattr(child, "n_heads", None), getattr(child, "head_dim", None)
            if isinstance(heads, int) and isinstance(head_dim, int):
                temp = max(temp, 3.0 * heads * head_dim)
                # q, k and v as the attention kernel keeps them (rotated, the key/value heads
                # repeated to the query heads), its output, and the residual sum
                act += 4 * heads * head_dim + dim
                # QK-norm: an RMSNorm per query head and per key/value head
                kv_heads = getattr(child, "n_kv_heads", None) or heads
                act += _norm_act(getattr(child, "q_norm", None), head_dim, heads)
                act += _norm_act(getattr(child, "k_norm", None), head_dim, int(kv_heads))
            elif isinstance(getattr(child, "kv_lora_rank", None), int):
                act += _mla_act(child, dim)
                qk = int(getattr(child, "qk_nope_head_dim")) + int(  # noqa: B009
                    getattr(child, "qk_rope_head_dim")  # noqa: B009
                )
                temp = max(temp, 3.0 * int(getattr(child, "n_heads")) * qk)  # noqa: B009
            else:  # other attentions: the projections' outputs and the residual sum
                act += out + dim
            kernels += 12 + 3 * linears
        else:
            # SwiGLU: w1 and w3 outputs (2/3 of the outputs that are not the w2 output), silu's
            # output and the gated product (each hidden-sized), and the residual sum (dim)
            inner = max(out - dim, 0)
            act += 2 * inner + dim
            temp = max(temp, float(inner))  # both factors' gradients (two hidden-sized)
            kernels += 4 + 3 * linears
    return dense, expert, n_experts, act, fixed, temp, kernels


def model_stats(model_name: str, flavor: str | Any, seq_len: int) -> ModelStats:
    """Count a registered model's parameters, FLOPs and activation sizes.

    Args:
        model_name: A registered model (``llama3``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``).
        flavor: A flavor name, or model arguments.
        seq_len: The training sequence length.

    Returns:
        The statistics.

    Raises:
        ValueError: An unknown model or flavor (the message lists the known ones).

    See Also:
        :titan:`torchtitan.models.utils.get_dense_model_nparams_and_flops`: TorchTitan's count.
    """
    from hp_trainer.protocols.model_spec import get_model_spec

    spec = get_model_spec(model_name)
    args = spec.model_args(flavor) if isinstance(flavor, str) else flavor
    flavor_name = flavor if isinstance(flavor, str) else "custom"
    with torch.device("meta"):
        model = spec.model_cls(args)
    moe_args = getattr(args, "moe_args", None)
    top_k = int(moe_args.top_k) if moe_args is not None else 0
    dim = int(args.dim)
    dense: list[int] = []
    expert: list[int] = []
    acts: list[float] = []
    fixed: list[float] = []
    temps: list[float] = []
    n_experts = 0
    kernels = 0
    for block in model.layers.values():  # type: ignore[operator]
        d, e, n, a, f, tmp, k = _block_stats(block, dim, top_k)
        temps.append(tmp)
        dense.append(d)
        expert.append(e)
        acts.append(a)
        fixed.append(f)
        n_experts = max(n_experts, n)
        kernels = max(kernels, k)
    tied = bool(getattr(args, "enable_weight_tying", False))
    embedding: Any = model.tok_embeddings
    embed = sum(p.numel() for p in embedding.parameters())
    total = sum(p.numel() for p in model.parameters())
    head = total - embed - sum(dense) - sum(expert)
    return ModelStats(
        name=f"{model_name}/{flavor_name}",
        n_layers=int(args.n_layers),
        dim=dim,
        n_heads=int(args.n_heads),
        n_kv_heads=int(getattr(args, "n_kv_heads", None) or args.n_heads),
        vocab_size=int(args.vocab_size),
        tied=tied,
        embed_params=int(embed),
        head_params=int(head),
        layer_dense_params=tuple(dense),
        layer_expert_params=tuple(expert),
        num_experts=n_experts,
        top_k=top_k,
        layer_act_elems=tuple(acts),
        flops_per_token=float(model.num_flops_per_token(seq_len)),  # type: ignore[operator]
        seq_len=seq_len,
        kernels_per_layer=kernels,
        layer_act_fixed_bytes=tuple(fixed),
        layer_bwd_temp_elems=tuple(temps),
    )
