"""Expert parallelism and MoE building blocks.

Plain modules usable on one device (:class:`TokenChoiceTopKRouter` / :class:`Router`,
:class:`GroupedExperts`, :class:`MoE`), the token dispatch (:class:`TokenDispatcher`,
:class:`DedupTokenDispatcher`, :func:`all_to_all_tokens`), the parallel styles for experts
(:class:`ExpertParallel`, :class:`ExpertTensorParallel`, :class:`TensorParallel`), the
auxiliary-loss-free bias update (:func:`update_expert_bias`) and load statistics
(:class:`ExpertLoad`).

See Also:
    :titan:`torchtitan.models.moe` and :titan:`torchtitan.distributed.expert_parallel`.
"""

from hp_cp_ep.ep.dedup import DedupDispatch, DedupTokenDispatcher, DeredundencyTokenDispatcher
from hp_cp_ep.ep.dispatch import (
    BackwardOverlap,
    DispatchedTokens,
    TokenDispatcher,
    all_to_all_tokens,
)
from hp_cp_ep.ep.experts import GroupedExperts, grouped_mm_supported
from hp_cp_ep.ep.load_balance import (
    moe_layers,
    register_expert_bias_update,
    update_expert_bias,
)
from hp_cp_ep.ep.moe import MoE, MoEArgs, SharedExperts
from hp_cp_ep.ep.replication import plan_hot_expert_replicas, update_hot_experts
from hp_cp_ep.ep.router import Router, Routing, TokenChoiceTopKRouter, load_balancing_loss
from hp_cp_ep.ep.stats import ExpertLoad, expert_load
from hp_cp_ep.ep.style import ExpertParallel, ExpertTensorParallel, TensorParallel

__all__ = [
    "BackwardOverlap",
    "DedupDispatch",
    "DedupTokenDispatcher",
    "DeredundencyTokenDispatcher",
    "DispatchedTokens",
    "ExpertLoad",
    "ExpertParallel",
    "ExpertTensorParallel",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "Router",
    "Routing",
    "SharedExperts",
    "TensorParallel",
    "TokenChoiceTopKRouter",
    "TokenDispatcher",
    "all_to_all_tokens",
    "expert_load",
    "grouped_mm_supported",
    "load_balancing_loss",
    "moe_layers",
    "plan_hot_expert_replicas",
    "register_expert_bias_update",
    "update_expert_bias",
    "update_hot_experts",
]
