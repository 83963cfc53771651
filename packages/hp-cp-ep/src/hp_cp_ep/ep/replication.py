"""Hot-expert replication: the most loaded experts get a second copy on lightly loaded ranks.

Routing is skewed: a few experts take most tokens, and the ranks holding them set the pace of
every step. :meth:`hp_cp_ep.TokenDispatcher.replicate_hot_experts` copies the ``K`` most loaded
experts (from the group's :class:`~hp_cp_ep.ExpertLoad`) to the ranks with the least load; each
rank then splits its rows for a hot expert evenly between owner and replica. The replica's
weights are fetched from the owner in every forward (one all-to-all of the ``K`` experts'
weights) and its gradient flows back into the owner's in the backward, so there is one
parameter per expert, optimizer state is unchanged, and training is the same as without
replication (the same sums, in another order).

Layout: every rank holds ``E_local`` owned experts and ``R = ceil(K / (ep - 1))`` replica slots
(zeros when unused), so the dispatch sees ``E_local + R`` slots per rank.

See Also:
    :func:`hp_cp_ep.update_expert_bias` (the loads); HyperParallel's hot-expert replication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_cp_ep.ep.dispatch import _AllToAllTokens

__all__ = ["plan_hot_expert_replicas", "update_hot_experts"]


def plan_hot_expert_replicas(
    tokens_per_expert: Sequence[float], ep_size: int, num_replicas: int
) -> list[tuple[int, int]]:
    """Where the ``num_replicas`` most loaded experts get their copy: the least loaded ranks.

    The ``K`` most loaded experts are taken in load order (ties: lower id first); each goes
    to the rank, other than its owner and with a free replica slot, whose estimated load is
    lowest (ties: lower rank), and the estimate moves half the expert's load from the owner to
    that rank. An expert whose copy would not leave both ranks below the owner's current load
    is skipped, so the plan may hold fewer than ``K`` replicas.

    Args:
        tokens_per_expert: ``[E]`` loads; expert ``e`` lives on rank ``e // (E / ep_size)``.
        ep_size: Expert-parallel ranks.
        num_replicas: ``K``, ``0 <= K <= E``.

    Returns:
        ``(expert, replica rank)`` pairs, most loaded expert first.

    Raises:
        ValueError: ``K`` out of range, or ``E`` not divisible by ``ep_size``.

    See Also:
        :meth:`hp_cp_ep.TokenDispatcher.replicate_hot_experts`, which installs the plan;
        :pt:`torch.topk` picks the most loaded experts the same way (ties aside).

    Example:
        >>> from hp_cp_ep import plan_hot_expert_replicas
        >>> plan_hot_expert_replicas([90, 5, 3, 2], ep_size=2, num_replicas=1)
        [(0, 1)]
    """
    num_experts = len(tokens_per_expert)
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not divide over ep_size={ep_size}")
    if not 0 <= num_replicas <= num_experts:
        raise ValueError(f"num_replicas must be in [0, {num_experts}], got {num_replicas}")
    if num_replicas == 0 or ep_size == 1:
        return []
    local = num_experts // ep_size
    loads = [float(v) for v in tokens_per_expert]
    rank_load = [sum(loads[q * local : (q + 1) * local]) for q in range(ep_size)]
    free = [math.ceil(num_replicas / (ep_size - 1))] * ep_size
    hot = sorted(range(num_experts), key=lambda e: (-loads[e], e))[:num_replicas]
    plan = []
    for expert in hot:
        owner = expert // local
        target = min(
            (q for q in range(ep_size) if q != owner and free[q] > 0),
            key=lambda q: (rank_load[q], q),
        )
        if rank_load[target] + loads[expert] / 2 >= rank_load[owner]:
            continue  # a copy there would not lower the busier of the two ranks
        free[target] -= 1
        rank_load[owner] -= loads[expert] / 2
        rank_load[target] += loads[expert] / 2
        plan.append((expert, target))
    return plan


class HotExpertReplicas:
    """A replication plan installed on a dispatcher: slot layout, row split, weight fetch."""

    def __init__(
        self,
        plan: list[tuple[int, int]],
        num_local_experts: int,
        ep_size: int,
        group: dist.ProcessGroup,
    ) -> None:
        self.plan = plan
        local, self.ep_size, self.group = num_local_experts, ep_size, group
        self.local = local
        self.replica_slots = math.ceil(len(plan) / max(ep_size - 1, 1))
        self.slots = local + self.replica_slots
        me = dist.get_rank(group)
        # replica slots of each rank, ordered by (owner, expert): the fetch receives in that order
        by_target: dict[int, list[int]] = {q: [] for q in range(ep_size)}
        for expert, target in plan:
            by_target[target].append(expert)
        self._replica_slot: dict[int, int] = {}
        for target, experts in by_target.items():
            for i, expert in enumerate(sorted(experts)):
                self._replica_slot[expert] = target * self.slots + local + i
        # the weight fetch: what this rank sends (its hot experts, by target then expert) and
        # receives (its replicas, by owner then expert)
        self._send_rows = [
            expert - me * local
            for target in range(ep_size)
            for expert in sorted(by_target[target])
            if expert // local == me
        ]
        self._send_splits = [
            sum(1 for e in by_target[q] if e // local == me) for q in range(ep_size)
        ]
        self._recv_splits = [
            sum(1 for e in by_target[me] if e // local == q) for q in range(ep_size)
        ]
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(owner slot of every expert, hot experts, their replica slots, the fetch's rows)."""
        if device not in self._tables:
            num_experts = self.local * self.ep_size
            owner = [(e // self.local) * self.slots + e % self.local for e in range(num_experts)]
            hot = sorted(self._replica_slot)
            replica = [self._replica_slot[e] for e in hot]
            # per choice (dropped: E): the owner slot (dropped: past the last slot) and the
            # replica slot (-1: not hot), for the de-duplicating dispatcher's remap
            owner_of = [*owner, self.ep_size * self.slots]
            replica_of = [self._replica_slot.get(e, -1) for e in range(num_experts + 1)]
            self._tables[device] = tuple(  # built once per plan and device, outside the step
                torch.tensor(values, dtype=torch.int64, device=device)
                for values in (owner, hot, replica, self._send_rows, owner_of, replica_of)
            )
        return self._tables[device]

    def remap_choices(self, experts: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` global experts (``E``: dropped) to slots; a hot expert's choices alternate
        between owner and replica by ``(token + choice)`` parity. No host sync."""
        tables = self._device_tables(experts.device)
        owner_of, replica_of = tables[4], tables[5]
        num_tokens, top_k = experts.shape
        parity = torch.arange(num_tokens, device=experts.device).view(-1, 1) + torch.arange(
            top_k, device=experts.device
        )
        replica = replica_of[experts]
        use_replica = (replica >= 0) & (parity % 2 == 1)
        return torch.where(use_replica, replica, owner_of[experts])

    def slot_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[ep * slots]`` rows per slot and the first source row of each slot's block.

        Rows arrive grouped by global expert; a hot expert's block is cut in two, the owner
        taking the first ``ceil(n / 2)`` rows and the replica the rest. No host sync.
        """
        owner, hot, replica = self._device_tables(counts.device)[:3]
        counts = counts.to(torch.int64)
        start = torch.cumsum(counts, 0) - counts
        to_replica = torch.zeros_like(counts).index_copy(0, hot, counts.index_select(0, hot) // 2)
        to_owner = counts - to_replica
        total = self.ep_size * self.slots
        slot_counts = torch.zeros(total, dtype=torch.int64, device=counts.device)
        source = torch.zeros(total, dtype=torch.int64, device=counts.device)
        slot_counts.scatter_(0, owner, to_owner)
        source.scatter_(0, owner, start)
        slot_counts.scatter_(0, replica, to_replica.index_select(0, hot))
        source.scatter_(0, replica, (start + to_owner).index_select(0, hot))
        return slot_counts, source

    def fetch(self, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Own weights followed by the replicas' (fetched, differentiable) and zero padding."""
        local = weights[0].shape[0]
        flat = torch.cat([w.reshape(local, -1) for w in weights], dim=1)
        sent = flat.index_select(0, self._device_tables(flat.device)[3])
        got: torch.Tensor = _AllToAllTokens.apply(  # type: ignore[no-untyped-call]
            sent, self._recv_splits, self._send_splits, self.group, None
        )
        pad = self.replica_slots - got.shape[0]
        if pad:
            got = torch.cat([got, got.new_zeros((pad, got.shape[1]))])
        out = []
        offset = 0
        for w in weights:
            size = w[0].numel()
            extra = got[:, offset : offset + size].reshape(self.replica_slots, *w.shape[1:])
            out.append(torch.cat([w, extra]))
            offset += size
        return tuple(out)


def update_hot_experts(
    model: nn.Module, loads: Mapping[str, Any], num_replicas: int
) -> dict[str, list[tuple[int, int]]]:
    """Re-plan the replicas of every MoE layer of ``model`` from its load.

    Args:
        model: The model (or a pipeline stage): every module named in ``loads`` with
            ``experts.token_dispatcher`` is re-planned.
        loads: ``{fqn: ExpertLoad}`` as :func:`hp_cp_ep.update_expert_bias` returns it (the
            group's load, the same on every rank).
        num_replicas: ``K`` hot experts per layer (0 removes the replicas).

    Returns:
        ``{fqn: plan}`` of the layers re-planned.

    Raises:
        ValueError: See :meth:`hp_cp_ep.TokenDispatcher.replicate_hot_experts`.

    See Also:
        :func:`hp_cp_ep.update_expert_bias`: the loads; TorchTitan's
        :titan:`build_optimizers_with_moe_load_balancing` hooks its bias update the same way.
    """
    plans = {}
    modules = dict(model.named_modules())
    for name, load in loads.items():
        module = modules.get(name)
        dispatcher = getattr(getattr(module, "experts", None), "token_dispatcher", None)
        if dispatcher is None or getattr(dispatcher, "ep_group", None) is None:
            continue
        plans[name] = dispatcher.replicate_hot_experts(load.tokens_per_expert, num_replicas)
    return plans
