"""Qwen 3 MoE (``Qwen3MoeForCausalLM`` layout): the model and its router.

Every block is an MoE block: grouped-query attention with per-head QK-norm (as dense Qwen 3),
then a softmax top-k router over ``num_experts`` SwiGLU experts whose top-k weights are
renormalized (``norm_topk_prob``) and applied to the experts' outputs; no shared experts and no
routing bias, so an exported checkpoint computes exactly what ``transformers`` computes.
"""

from __future__ import annotations

from hp_cp_ep import MoEArgs
from hp_trainer.models.common.decoder import Attention
from hp_trainer.models.common.moe_decoder import MoEDecoder, MoEDecoderArgs

__all__ = ["Qwen3MoE", "qwen3_moe_routing"]


def qwen3_moe_routing(num_experts: int, top_k: int) -> MoEArgs:
    """Qwen 3 MoE's router: softmax over ``num_experts``, top ``top_k`` renormalized, no bias.

    Args:
        num_experts: Routed experts.
        top_k: Experts per token.

    Returns:
        The routing arguments.
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


class Qwen3MoE(MoEDecoder):
    """The Qwen 3 MoE decoder: QK-normed grouped-query attention and MoE feed-forwards.

    Args:
        args: Model arguments (an entry of ``qwen3_moe_flavors`` in
            ``hp_trainer.models.qwen3_moe.flavors``).

    See Also:
        :titan:`torchtitan.models.qwen3` (its MoE flavors); ``transformers.Qwen3MoeForCausalLM``.
    """

    def __init__(self, args: MoEDecoderArgs) -> None:
        assert args.head_dim is not None
        super().__init__(args, Attention, rope_dim=args.head_dim)
